"""Word lists for the procedural word-problem generator (names, objects, places, units)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

FEMALE_NAMES: Tuple[str, ...] = (
    "Natalia", "Betty", "Julie", "Emma", "Sofia", "Amara", "Priya", "Mei", "Lucia", "Hannah",
    "Olivia", "Fatima", "Grace", "Chloe", "Isabel", "Nadia", "Rosa", "Keiko", "Aisha", "Maya",
    "Elena", "Zoe", "Lily", "Carmen", "Ingrid", "Tamara", "Ruth", "Leah", "Janet", "Sandra",
    "Wendy", "Paula", "Brianna", "Yuki", "Ana", "Marie", "Nora", "Kendra", "Gloria", "Tina",
)
MALE_NAMES: Tuple[str, ...] = (
    "James", "Mark", "Tom", "Carlos", "Ahmed", "Kenji", "Liam", "Noah", "Ravi", "Diego",
    "Samuel", "Omar", "Felix", "Marco", "Ethan", "Jamal", "Hiro", "Lucas", "Ivan", "Pedro",
    "Henry", "Jack", "Daniel", "Andre", "Kevin", "Tyler", "Brandon", "Oscar", "Mateo", "Victor",
    "Raymond", "Gary", "Paul", "Joel", "Arjun", "Sean", "Leo", "Frank", "Dmitri", "Walter",
)


@dataclass(frozen=True)
class Person:
    """A named person with pronouns: ``he``/``she``, ``his``/``her``, ``him``/``her``."""

    name: str
    he: str
    his: str
    him: str


def person(rng, exclude: Tuple[str, ...] = ()) -> Person:
    """A random person (never one of ``exclude``'s names)."""
    while True:
        if rng.random() < 0.5:
            p = Person(rng.choice(FEMALE_NAMES), "she", "her", "her")
        else:
            p = Person(rng.choice(MALE_NAMES), "he", "his", "him")
        if p.name not in exclude:
            return p


def people(rng, n: int) -> Tuple[Person, ...]:
    """``n`` distinct random people."""
    out: list = []
    while len(out) < n:
        out.append(person(rng, tuple(q.name for q in out)))
    return tuple(out)


# (singular, plural, low price in dollars, high price in dollars)
SHOP_ITEMS = (
    ("notebook", "notebooks", 2, 6), ("pen", "pens", 1, 3), ("apple", "apples", 1, 2),
    ("book", "books", 8, 25), ("shirt", "shirts", 10, 30), ("toy car", "toy cars", 3, 12),
    ("candle", "candles", 4, 15), ("plant", "plants", 5, 20), ("cupcake", "cupcakes", 2, 5),
    ("sandwich", "sandwiches", 4, 9), ("puzzle", "puzzles", 7, 18), ("mug", "mugs", 5, 14),
    ("hat", "hats", 9, 22), ("bracelet", "bracelets", 3, 16), ("ticket", "tickets", 6, 30),
    ("board game", "board games", 12, 40), ("pair of socks", "pairs of socks", 2, 8),
    ("bag of chips", "bags of chips", 1, 4), ("movie", "movies", 3, 15), ("lamp", "lamps", 15, 45),
)
# countable things people collect, grow, bake or sell
COLLECTIBLES = (
    ("sticker", "stickers"), ("marble", "marbles"), ("stamp", "stamps"), ("seashell", "seashells"),
    ("baseball card", "baseball cards"), ("coin", "coins"), ("bead", "beads"), ("postcard", "postcards"),
    ("comic book", "comic books"), ("pebble", "pebbles"), ("button", "buttons"), ("feather", "feathers"),
)
BAKED = (
    ("cookie", "cookies"), ("muffin", "muffins"), ("brownie", "brownies"), ("cupcake", "cupcakes"),
    ("pie", "pies"), ("loaf of bread", "loaves of bread"), ("bagel", "bagels"), ("scone", "scones"),
)
FRUITS = (
    ("apple", "apples"), ("orange", "oranges"), ("peach", "peaches"), ("lemon", "lemons"),
    ("pear", "pears"), ("mango", "mangoes"), ("plum", "plums"), ("tomato", "tomatoes"),
)
PLANTS = (
    ("tomato plant", "tomato plants"), ("rose bush", "rose bushes"), ("sunflower", "sunflowers"),
    ("carrot", "carrots"), ("pepper plant", "pepper plants"), ("tulip", "tulips"), ("cabbage", "cabbages"),
)
CONTAINERS = (("box", "boxes"), ("crate", "crates"), ("basket", "baskets"), ("bag", "bags"), ("carton", "cartons"))
JOBS = (
    "babysitting", "tutoring", "walking dogs", "mowing lawns", "washing cars", "working at the bakery",
    "working at the library", "delivering newspapers", "cleaning offices", "painting fences",
)
VEHICLES = ("car", "truck", "van", "motorcycle", "bus")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
PLACES = ("the farmers' market", "the school fair", "the bake sale", "the flea market", "the street fair",
          "the county fair", "the craft show")
ANIMALS_2 = (("chicken", "chickens"), ("duck", "ducks"), ("goose", "geese"), ("turkey", "turkeys"))
ANIMALS_4 = (("cow", "cows"), ("goat", "goats"), ("sheep", "sheep"), ("pig", "pigs"), ("horse", "horses"))
MULTIPLE_WORDS = {2: "twice", 3: "three times", 4: "four times", 5: "five times"}
FRACTION_WORDS = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth"}

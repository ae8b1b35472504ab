"""Seeded, deterministic generator of grade-school word problems in GSM8K's form.

Each problem is multi-step arithmetic written as prose, with every calculation annotated as in
GSM8K (Cobbe et al. 2021, section 2): ``Natalia sold 48/2 = <<48/2=24>>24 clips in May.`` and a
final line ``#### 72``. Many templates (shopping, rates, ages, distance, recipes, savings,
percentages, sharing, ...) with several phrasings each, random people, objects and units, so
the text is varied language, not one sentence pattern.

Determinism: problem ``index`` of ``seed`` depends only on ``(seed, index)`` (its own
``random.Random``), so ``generate_problems(n, seed)`` is a prefix of ``generate_problems(m, seed)``
for ``n <= m`` and identical across processes and Python runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterator, List, Tuple

from mtpspec.training import lexicon as lx
from mtpspec.training.calc import chain, fmt, step


@dataclass(frozen=True)
class WordProblem:
    """One problem: ``question`` text and GSM8K-style ``answer`` (steps, then ``#### n``)."""

    question: str
    answer: str
    template: str

    @property
    def final_answer(self) -> str:
        """The text after ``#### `` on the answer's last line."""
        return self.answer.rsplit("#### ", 1)[1].strip()


def _finish(question: str, lines: List[str], final) -> Tuple[str, str]:
    return question, "\n".join(lines + [f"#### {fmt(final)}"])


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _a(noun: str) -> str:
    """``"a book"`` / ``"an apple"``."""
    return ("an " if noun[0] in "aeiou" else "a ") + noun


_BASE_VERB = {"sold": "sell", "made": "make", "collected": "collect", "gave away": "give away"}


# ---------------------------------------------------------------------------------------------
# Templates: each takes a random.Random and returns (question, answer).
# ---------------------------------------------------------------------------------------------

def t_shopping_change(r: random.Random):
    p = lx.person(r)
    (s1, p1, lo1, hi1), (s2, p2, lo2, hi2) = r.sample(lx.SHOP_ITEMS, 2)
    n1, n2 = r.randint(2, 6), r.randint(2, 5)
    c1, c2 = r.randint(lo1, hi1), r.randint(lo2, hi2)
    t1, v1 = step(n1, "*", c1, unit_prefix="$", text_op=" x ")
    t2, v2 = step(n2, "*", c2, unit_prefix="$", text_op=" x ")
    t3, total = step(v1, "+", v2, unit_prefix="$")
    bill = next(b for b in (20, 50, 100, 200, 500) if b >= total)
    t4, change = step(bill, "-", total, unit_prefix="$")
    q = r.choice([
        f"{p.name} buys {n1} {p1} for ${c1} each and {n2} {p2} for ${c2} each. {_cap(p.he)} pays with a ${bill} bill. How much change does {p.he} get back?",
        f"At the store, {p.name} picked up {n1} {p1} that cost ${c1} apiece and {n2} {p2} that cost ${c2} apiece. If {p.he} handed the cashier ${bill}, how much change did {p.he} receive?",
        f"{p.name} has ${bill}. {_cap(p.he)} spends it on {n1} {p1} at ${c1} each and {n2} {p2} at ${c2} each. How much money does {p.he} have left?",
    ])
    return _finish(q, [f"The {p1} cost {t1}.", f"The {p2} cost {t2}.",
                       f"In total {p.he} spends {t3}.", f"So {p.he} gets back {t4}."], change)


def t_sales_days(r: random.Random):
    p = lx.person(r)
    s, pl = r.choice(lx.BAKED + lx.COLLECTIBLES)
    d = r.randint(0, 4)
    day1, day2, day3 = lx.DAYS[d], lx.DAYS[d + 1], lx.DAYS[d + 2]
    m = r.choice([2, 3, 4])
    a = r.randint(5, 40)
    less = r.randint(1, a * m - 1)
    t1, b = step(a, "*", m)
    t2, c = step(b, "-", less)
    t3, total = chain([a, b, c], "+")
    verb = r.choice(sorted(_BASE_VERB))
    q = (f"{p.name} {verb} {a} {pl} on {day1}. On {day2}, {p.he} {verb} {lx.MULTIPLE_WORDS[m]} as many {pl}, "
         f"and on {day3} {p.he} {verb} {less} fewer than on {day2}. How many {pl} did {p.name} {_BASE_VERB[verb]} "
         f"{'in total' if r.random() < 0.5 else 'over the three days'}?")
    return _finish(q, [f"On {day2} {p.he} {verb} {t1} {pl}.", f"On {day3} {p.he} {verb} {t2} {pl}.",
                       f"Altogether {p.he} {verb} {t3} {pl}."], total)


def t_hourly_wage(r: random.Random):
    p = lx.person(r)
    job = r.choice(lx.JOBS)
    rate = r.randint(8, 30)
    hours = r.randint(2, 8)
    days = r.randint(2, 6)
    frac = r.choice([2, 4, 5])
    t1, per_day = step(rate, "*", hours, unit_prefix="$")
    t2, total = step(per_day, "*", days, unit_prefix="$")
    # choose values so the spent part is exact in cents
    t3, spent = step(total, "/", frac, unit_prefix="$")
    t4, left = step(total, "-", spent, unit_prefix="$")
    q = r.choice([
        f"{p.name} earns ${rate} an hour {job}. {_cap(p.he)} works {hours} hours a day for {days} days. {_cap(p.he)} spends {lx.FRACTION_WORDS[frac]} of the money on a gift. How much money does {p.he} have left?",
        f"{p.name} gets paid ${rate} per hour for {job}. This week {p.he} worked {hours} hours on each of {days} days, then spent {lx.FRACTION_WORDS[frac]} of {p.his} earnings. How much of {p.his} earnings remain?",
    ])
    return _finish(q, [f"Each day {p.he} earns {t1}.", f"Over {days} days {p.he} earns {t2}.",
                       f"{_cap(p.he)} spends {t3}.", f"{_cap(p.he)} has {t4} left."], left)


def t_ages(r: random.Random):
    a, b, c = lx.people(r, 3)
    c_age = r.choice(range(8, 60, 2))
    half, b_age = step(c_age, "/", 2)
    diff = r.randint(2, 15)
    t2, a_age = step(b_age, "+", diff)
    years = r.randint(2, 10)
    t3, total = chain([a_age, b_age, c_age], "+")
    if r.random() < 0.5:
        q = (f"{a.name} is {diff} years older than {b.name}. {b.name} is half as old as {c.name}. "
             f"If {c.name} is {c_age} years old, what is the sum of their ages?")
        return _finish(q, [f"{b.name} is {half} years old.", f"{a.name} is {t2} years old.",
                           f"The sum of their ages is {t3} years."], total)
    t4, future = step(a_age, "+", years)
    q = (f"{c.name} is {c_age} years old. {b.name} is half {c.name}'s age, and {a.name} is {diff} years older "
         f"than {b.name}. How old will {a.name} be in {years} years?")
    return _finish(q, [f"{b.name} is {half} years old.", f"{a.name} is {t2} years old now.",
                       f"In {years} years {a.name} will be {t4} years old."], future)


def t_distance(r: random.Random):
    p = lx.person(r)
    veh = r.choice(lx.VEHICLES)
    s1, h1 = r.choice(range(30, 75, 5)), r.randint(1, 5)
    s2, h2 = r.choice(range(20, 65, 5)), r.randint(1, 4)
    t1, d1 = step(s1, "*", h1)
    t2, d2 = step(s2, "*", h2)
    t3, d = step(d1, "+", d2)
    q = r.choice([
        f"{p.name} drives {p.his} {veh} at {s1} miles per hour for {h1} hours, then at {s2} miles per hour for {h2} hours. How many miles does {p.he} travel in total?",
        f"{_cap(_a(veh))} travels for {h1} hours at a speed of {s1} mph and then for {h2} more hours at {s2} mph. What total distance does it cover, in miles?",
    ])
    return _finish(q, [f"First part: {t1} miles.", f"Second part: {t2} miles.", f"Total distance: {t3} miles."], d)


def t_recipe(r: random.Random):
    p = lx.person(r)
    s, pl = r.choice(lx.BAKED)
    per = r.randint(2, 5)
    batches = r.randint(2, 8)
    have = r.randint(1, per * batches - 1)
    unit = r.choice(["cups of flour", "eggs", "cups of sugar", "sticks of butter", "cups of milk"])
    yield_ = r.randint(6, 24)
    t1, need = step(per, "*", batches)
    t2, more = step(need, "-", have)
    t3, made = step(yield_, "*", batches)
    if r.random() < 0.5:
        q = (f"A batch of {pl} needs {per} {unit}. {p.name} wants to bake {batches} batches but only has {have} {unit}. "
             f"How many more {unit} does {p.he} need?")
        return _finish(q, [f"{_cap(p.he)} needs {t1} {unit}.", f"{_cap(p.he)} needs {t2} more {unit}."], more)
    q = (f"{p.name} bakes {batches} batches of {pl} with {yield_} {pl} in each batch. Each batch uses {per} {unit}. "
         f"How many {pl} does {p.he} bake in all?")
    return _finish(q, [f"{_cap(p.he)} uses {t1} {unit}.", f"{_cap(p.he)} bakes {t3} {pl}."], made)


def t_garden(r: random.Random):
    p = lx.person(r)
    s, pl = r.choice(lx.PLANTS)
    rows, per = r.randint(3, 12), r.randint(4, 15)
    frac = r.choice([2, 3, 4, 5])
    t1, total = step(rows, "*", per)
    # make total divisible by frac
    while total % frac:
        per += 1
        t1, total = step(rows, "*", per)
    t2, lost = step(total, "/", frac)
    t3, left = step(total, "-", lost)
    pest = r.choice(["rabbits", "deer", "a late frost", "beetles", "the neighbor's goats"])
    q = (f"{p.name} plants {rows} rows of {pl} with {per} {pl} in each row. {_cap(pest)} ruin {lx.FRACTION_WORDS[frac]} of them. "
         f"How many {pl} are left?")
    return _finish(q, [f"{_cap(p.he)} planted {t1} {pl}.", f"{_cap(pest)} ruined {t2} {pl}.",
                       f"There are {t3} {pl} left."], left)


def t_savings(r: random.Random):
    p = lx.person(r)
    weekly = r.randint(5, 40)
    weeks = r.randint(3, 20)
    s, pl, lo, hi = r.choice(lx.SHOP_ITEMS)
    t1, saved = step(weekly, "*", weeks, unit_prefix="$")
    price = r.randint(max(lo, 1), max(hi, 2)) * r.randint(1, 3)
    while price > saved:
        price = max(1, price // 2)
    t2, left = step(saved, "-", price, unit_prefix="$")
    q = r.choice([
        f"{p.name} saves ${weekly} every week for {weeks} weeks. Then {p.he} buys {_a(s)} for ${price}. How much money does {p.he} have left?",
        f"Every week {p.name} puts ${weekly} into a piggy bank. After {weeks} weeks, {p.he} spends ${price} on {_a(s)}. How many dollars are left in the piggy bank?",
    ])
    return _finish(q, [f"{_cap(p.he)} saves {t1}.", f"After buying the {s}, {p.he} has {t2} left."], left)


def t_percent_class(r: random.Random):
    n = r.choice([20, 25, 30, 40, 50, 60, 80, 100, 120, 200])
    pct = r.choice([10, 20, 25, 30, 40, 50, 60, 75, 80])
    while (n * pct) % 100:
        pct = r.choice([10, 20, 25, 50])
    group, other = r.choice([("girls", "boys"), ("students who walk to school", "students who take the bus"),
                             ("students who play soccer", "students who do not play soccer")])
    t1, x = step(Fraction(pct, 100) * 100, "/", 100)
    t2, cnt = step(n, "*", x)
    t3, rest = step(n, "-", cnt)
    q = r.choice([
        f"A school has {n} students and {pct}% of them are {group}. How many {other} are there?",
        f"In a group of {n} children, {pct}% are {group}. How many are {other}?",
    ])
    return _finish(q, [f"{pct}% is {t1}.", f"There are {t2} {group}.", f"So there are {t3} {other}."], rest)


def t_give_away(r: random.Random):
    p = lx.person(r)
    s, pl = r.choice(lx.COLLECTIBLES)
    friends, each = r.randint(2, 6), r.randint(2, 12)
    t1, given = step(friends, "*", each)
    start = given + r.randint(5, 80)
    bought = r.randint(3, 40)
    t2, mid = step(start, "-", given)
    t3, end = step(mid, "+", bought)
    q = r.choice([
        f"{p.name} has {start} {pl}. {_cap(p.he)} gives {each} {pl} to each of {p.his} {friends} friends and then buys {bought} more. How many {pl} does {p.he} have now?",
        f"{p.name} collected {start} {pl}. {_cap(p.he)} shared them by giving {friends} friends {each} {pl} each, and later found {bought} more. How many {pl} does {p.name} have?",
    ])
    return _finish(q, [f"{_cap(p.he)} gives away {t1} {pl}.", f"{_cap(p.he)} has {t2} {pl} left.",
                       f"After getting more, {p.he} has {t3} {pl}."], end)


def t_reading(r: random.Random):
    p = lx.person(r)
    per_day, days = r.randint(8, 40), r.randint(2, 9)
    t1, read = step(per_day, "*", days)
    total = read + r.randint(10, 300)
    t2, left = step(total, "-", read)
    if r.random() < 0.5:
        q = (f"A book has {total} pages. {p.name} reads {per_day} pages a day for {days} days. "
             f"How many pages does {p.he} still have to read?")
        return _finish(q, [f"{_cap(p.he)} reads {t1} pages.", f"{_cap(p.he)} has {t2} pages left."], left)
    more_days = r.randint(2, 6)
    while left % more_days:
        total += 1
        t2, left = step(total, "-", read)
    t3, rate = step(left, "/", more_days)
    q = (f"{p.name} is reading a {total}-page novel. {_cap(p.he)} read {per_day} pages each day for {days} days. "
         f"If {p.he} wants to finish the book in the next {more_days} days, how many pages a day must {p.he} read?")
    return _finish(q, [f"{_cap(p.he)} has read {t1} pages.", f"{t2} pages remain.",
                       f"{_cap(p.he)} must read {t3} pages a day."], rate)


def t_fruit_boxes(r: random.Random):
    p = lx.person(r)
    s, pl = r.choice(lx.FRUITS)
    cs, cpl = r.choice(lx.CONTAINERS)
    boxes, per = r.randint(3, 20), r.randint(6, 40)
    price = r.choice([Fraction(1, 2), Fraction(1, 4), 1, 2, 3, Fraction(3, 2)])
    place = r.choice(lx.PLACES)
    t1, count = step(boxes, "*", per)
    t2, money = step(count, "*", price, unit_prefix="$")
    q = (f"{p.name} brings {boxes} {cpl} of {pl} to {place}. Each {cs} holds {per} {pl}. If {p.he} sells every one "
         f"of them for ${fmt(price)} each, how much money does {p.he} make?")
    return _finish(q, [f"{_cap(p.he)} has {t1} {pl}.", f"{_cap(p.he)} makes {t2}."], money)


def t_time_tasks(r: random.Random):
    p = lx.person(r)
    task = r.choice(["wash a car", "grade a test", "paint a chair", "fold a shirt", "answer an email", "bake a tray of cookies"])
    tasks_ = task.split(" ", 1)[1]
    mins = r.choice([3, 4, 5, 6, 10, 12, 15, 20, 30])
    n = r.randint(2, 30)
    t1, total = step(mins, "*", n)
    while total % 60:
        n += 1
        t1, total = step(mins, "*", n)
    t2, hours = step(total, "/", 60)
    q = f"It takes {p.name} {mins} minutes to {task}. How many hours does it take {p.him} to {task.split(' ')[0]} {n} of them?"
    return _finish(q, [f"It takes {t1} minutes.", f"That is {t2} hours."], hours)


def t_discount(r: random.Random):
    p = lx.person(r)
    s, pl, lo, hi = r.choice(lx.SHOP_ITEMS)
    price = r.randint(lo, hi) * 4
    pct = r.choice([10, 20, 25, 50])
    n = r.randint(1, 5)
    t1, off = step(price * pct, "/", 100, unit_prefix="$")
    t2, sale = step(price, "-", off, unit_prefix="$")
    t3, total = step(sale, "*", n, unit_prefix="$")
    q = r.choice([
        f"{_cap(_a(s))} normally costs ${price}. It is on sale for {pct}% off. How much does {p.name} pay for {n} of them?",
        f"{p.name} wants {n} {pl if n > 1 else s}. The regular price is ${price} each, but there is a {pct}% discount today. How much does {p.he} spend?",
    ])
    return _finish(q, [f"The discount is {t1}.", f"Each costs {t2}.", f"{_cap(p.he)} pays {t3}."], total)


def t_share_equally(r: random.Random):
    a = lx.person(r)
    s, pl = r.choice(lx.COLLECTIBLES + lx.FRUITS)
    k = r.randint(2, 8)
    each = r.randint(3, 25)
    kept = r.randint(0, 20)
    total = k * each + kept
    t1, shared = step(total, "-", kept)
    t2, e = step(shared, "/", k)
    q = (f"{a.name} has {total} {pl}. {_cap(a.he)} keeps {kept} for {a.him}self and shares the rest "
         f"equally among {k} friends. How many {pl} does each friend get?")
    return _finish(q, [f"{_cap(a.he)} shares {t1} {pl}.", f"Each friend gets {t2} {pl}."], e)


def t_legs(r: random.Random):
    p = lx.person(r)
    (s2, p2), (s4, p4) = r.choice(lx.ANIMALS_2), r.choice(lx.ANIMALS_4)
    n2, n4 = r.randint(2, 30), r.randint(2, 20)
    t1, l2 = step(n2, "*", 2)
    t2, l4 = step(n4, "*", 4)
    t3, total = step(l2, "+", l4)
    q = f"{p.name}'s farm has {n2} {p2} and {n4} {p4}. How many legs do the animals have altogether?"
    return _finish(q, [f"The {p2} have {t1} legs.", f"The {p4} have {t2} legs.", f"Altogether there are {t3} legs."], total)


def t_tickets(r: random.Random):
    event = r.choice(["school play", "concert", "magic show", "science fair", "charity dinner", "puppet show"])
    adult, child = r.randint(6, 20), r.randint(2, 8)
    na, nc = r.randint(10, 200), r.randint(10, 300)
    t1, va = step(na, "*", adult, unit_prefix="$")
    t2, vc = step(nc, "*", child, unit_prefix="$")
    t3, total = step(va, "+", vc, unit_prefix="$")
    q = (f"Tickets to the {event} cost ${adult} for adults and ${child} for children. "
         f"If {na} adult tickets and {nc} child tickets were sold, how much money was raised?")
    return _finish(q, [f"Adult tickets raised {t1}.", f"Child tickets raised {t2}.", f"In total {t3} was raised."], total)


def t_doubling(r: random.Random):
    p = lx.person(r)
    s, pl = r.choice(lx.COLLECTIBLES)
    start = r.randint(2, 30)
    weeks = r.randint(2, 4)
    lines, v = [], Fraction(start)
    for w in range(1, weeks + 1):
        t, v = step(v, "*", 2)
        lines.append(f"After week {w} {p.he} has {t} {pl}.")
    q = f"{p.name} has {start} {pl}. Every week the number of {pl} {p.he} has doubles. How many {pl} will {p.he} have after {weeks} weeks?"
    return _finish(q, lines, v)


def t_packs(r: random.Random):
    p = lx.person(r)
    item = r.choice([("pencil", "pencils"), ("marker", "markers"), ("eraser", "erasers"), ("crayon", "crayons")])
    per_pack = r.choice([4, 5, 6, 8, 10, 12])
    students, each = r.randint(5, 30), r.randint(1, 4)
    t1, need = step(students, "*", each)
    while need % per_pack:
        students += 1
        t1, need = step(students, "*", each)
    t2, packs = step(need, "/", per_pack)
    cost = r.randint(2, 6)
    t3, money = step(packs, "*", cost, unit_prefix="$")
    q = (f"{p.name} is a teacher with {students} students. Each student needs {each} {item[1] if each > 1 else item[0]}. "
         f"{_cap(item[1])} come in packs of {per_pack} that cost ${cost} per pack. How much will {p.he} spend?")
    return _finish(q, [f"{_cap(p.he)} needs {t1} {item[1]}.", f"That is {t2} packs.", f"{_cap(p.he)} spends {t3}."], money)


def t_fuel(r: random.Random):
    p = lx.person(r)
    mpg = r.choice([20, 25, 30, 35, 40])
    gallons = r.randint(2, 12)
    trip = mpg * gallons
    price = r.choice([3, 4, Fraction(7, 2), Fraction(5, 2), 5])
    t1, g = step(trip, "/", mpg)
    t2, cost = step(g, "*", price, unit_prefix="$")
    q = (f"{p.name}'s {r.choice(lx.VEHICLES)} gets {mpg} miles per gallon. {_cap(p.he)} is driving {trip} miles and gas costs "
         f"${fmt(price)} per gallon. How much will {p.he} spend on gas?")
    return _finish(q, [f"{_cap(p.he)} needs {t1} gallons.", f"Gas costs {t2}."], cost)


def t_area_paint(r: random.Random):
    p = lx.person(r)
    length, width = r.randint(6, 30), r.randint(5, 20)
    walls = r.randint(1, 4)
    cover = r.choice([20, 25, 40, 50, 100])
    t1, area = step(length, "*", width)
    t2, total = step(area, "*", walls)
    while total % cover:
        length += 1
        t1, area = step(length, "*", width)
        t2, total = step(area, "*", walls)
    t3, cans = step(total, "/", cover)
    q = (f"{p.name} is painting {walls} {'wall' if walls == 1 else 'walls'} that are each {length} feet long and {width} feet high. "
         f"One can of paint covers {cover} square feet. How many cans does {p.he} need?")
    return _finish(q, [f"Each wall is {t1} square feet.", f"All the walls are {t2} square feet.", f"{_cap(p.he)} needs {t3} cans."], cans)


def t_compare(r: random.Random):
    a, b, c = lx.people(r, 3)
    s, pl = r.choice(lx.COLLECTIBLES + lx.FRUITS)
    bn = r.randint(3, 40)
    m = r.choice([2, 3, 4, 5])
    t1, an = step(bn, "*", m)
    fewer = r.randint(1, min(10, int(an) - 1))
    t2, cn = step(an, "-", fewer)
    t3, total = chain([an, bn, cn], "+")
    q = (f"{a.name} has {lx.MULTIPLE_WORDS[m]} as many {pl} as {b.name}. {c.name} has {fewer} fewer {pl} than {a.name}. "
         f"If {b.name} has {bn} {pl}, how many {pl} do they have together?")
    return _finish(q, [f"{a.name} has {t1} {pl}.", f"{c.name} has {t2} {pl}.", f"Together they have {t3} {pl}."], total)


def t_tank(r: random.Random):
    fill, leak = r.randint(5, 20), r.randint(1, 4)
    minutes = r.randint(5, 40)
    t1, net = step(fill, "-", leak)
    t2, water = step(net, "*", minutes)
    thing = r.choice(["A water tank", "A bathtub", "A swimming pool", "A fish tank", "A rain barrel"])
    q = (f"{thing} is being filled at {fill} gallons per minute, but it leaks {leak} "
         f"{'gallon' if leak == 1 else 'gallons'} per minute. How much water is in it after {minutes} minutes if it started empty?")
    return _finish(q, [f"It gains {t1} gallons each minute.", f"After {minutes} minutes it holds {t2} gallons."], water)


def t_salary_raise(r: random.Random):
    p = lx.person(r)
    monthly = r.randint(15, 60) * 100
    pct = r.choice([5, 10, 20, 25])
    t1, raise_ = step(monthly * pct, "/", 100, unit_prefix="$")
    t2, new = step(monthly, "+", raise_, unit_prefix="$")
    t3, year = step(new, "*", 12, unit_prefix="$")
    q = (f"{p.name} earns ${monthly} a month. {_cap(p.he)} gets a {pct}% raise. How much will {p.he} earn in a year "
         f"with the new salary?")
    return _finish(q, [f"The raise is {t1}.", f"{_cap(p.his)} new monthly salary is {t2}.", f"In a year {p.he} earns {t3}."], year)


def t_pizza(r: random.Random):
    p = lx.person(r)
    pizzas, slices = r.randint(2, 10), r.choice([6, 8, 10, 12])
    guests, each = r.randint(3, 15), r.randint(1, 3)
    t1, total = step(pizzas, "*", slices)
    while guests * each > total:
        guests -= 1
    t2, eaten = step(guests, "*", each)
    t3, left = step(total, "-", eaten)
    q = (f"{p.name} orders {pizzas} pizzas for a party, and each pizza is cut into {slices} slices. "
         f"{guests} guests eat {each} {'slice' if each == 1 else 'slices'} each. How many slices are left over?")
    return _finish(q, [f"There are {t1} slices.", f"The guests eat {t2} slices.", f"{t3} slices are left."], left)


def t_monthly_bills(r: random.Random):
    p = lx.person(r)
    rent, food, other = r.randint(5, 20) * 100, r.randint(15, 60) * 10, r.randint(5, 40) * 10
    months = r.randint(2, 12)
    t1, per = chain([rent, food, other], "+", unit_prefix="$")
    t2, total = step(per, "*", months, unit_prefix="$")
    month = r.choice(lx.MONTHS)
    q = (f"Every month {p.name} pays ${rent} in rent, ${food} for food and ${other} for utilities. "
         f"Starting in {month}, how much does {p.he} pay over {months} months?")
    return _finish(q, [f"Each month {p.he} pays {t1}.", f"Over {months} months {p.he} pays {t2}."], total)


def t_bus_stops(r: random.Random):
    start = r.randint(10, 40)
    off1, on1 = r.randint(1, start - 1), r.randint(1, 15)
    t1, a = step(start, "-", off1)
    t2, b = step(a, "+", on1)
    off2 = r.randint(1, int(b))
    t3, c = step(b, "-", off2)
    q = (f"A bus leaves the station with {start} passengers. At the first stop {off1} people get off and {on1} get on. "
         f"At the second stop {off2} people get off. How many passengers are on the bus now?")
    return _finish(q, [f"After some get off there are {t1} passengers.", f"Then {t2} passengers.",
                       f"After the second stop there are {t3} passengers."], c)


TEMPLATES: Tuple[Callable[[random.Random], Tuple[str, str]], ...] = (
    t_shopping_change, t_sales_days, t_hourly_wage, t_ages, t_distance, t_recipe, t_garden, t_savings,
    t_percent_class, t_give_away, t_reading, t_fruit_boxes, t_time_tasks, t_discount, t_share_equally,
    t_legs, t_tickets, t_doubling, t_packs, t_fuel, t_area_paint, t_compare, t_tank, t_salary_raise,
    t_pizza, t_monthly_bills, t_bus_stops,
)


def generate_problem(seed: int, index: int) -> WordProblem:
    """Problem number ``index`` (>= 0) of the stream ``seed``; a pure function of both.

    Raises:
        ValueError: negative ``index``.
    """
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    r = random.Random(seed * 1_000_003 + index)
    tpl = TEMPLATES[r.randrange(len(TEMPLATES))]
    q, a = tpl(r)
    return WordProblem(question=q, answer=a, template=tpl.__name__)


def iter_problems(seed: int, start: int = 0) -> Iterator[WordProblem]:
    """Endless stream ``generate_problem(seed, start), generate_problem(seed, start + 1), ...``."""
    i = start
    while True:
        yield generate_problem(seed, i)
        i += 1


def generate_problems(n: int, seed: int) -> List[WordProblem]:
    """The first ``n`` problems of stream ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [generate_problem(seed, i) for i in range(n)]

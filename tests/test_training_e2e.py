"""End to end: a very small training run on the CPU (real GSM8K rows, generated problems, the
real tokenizer, model and loss); the loss must fall, and the written checkpoint must load into
mtpspec and into Hugging Face transformers with the same logits."""

import json
import os

import pytest
import torch

from mtpspec.training.train import TrainConfig, train


def _train_one_thread(cfg: TrainConfig):
    """``train(cfg)`` on one CPU thread (deterministic and fair to the other tests), no log."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(cfg, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ci_model"))
    cfg = TrainConfig(output_dir=out, preset="ci", gsm8k_limit=300, holdout=20, num_synthetic=1500,
                      tokenizer_synthetic=1500, gsm8k_epochs=1, tokens_per_batch=2048, max_steps=24, max_minutes=0,
                      lr=1e-2, warmup_steps=4, log_every=1, eval_every=0, eval_docs=6, accept_prompts=1,
                      accept_max_new=8, device="cpu", dtype="float32", save_dtype="float32", progress=False,
                      distill_fraction=0.0)
    summary = _train_one_thread(cfg)
    return out, summary


def test_losses_fall_and_are_logged(run):
    out, summary = run
    recs = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert len(train_recs) == 24 and summary["steps"] == 24
    first, last = train_recs[0], train_recs[-4:]
    mean_t = sum(r["target_loss"] for r in last) / 4
    mean_m = sum(r["mtp_loss"][0] for r in last) / 4
    assert mean_t < first["target_loss"] - 1.0, (first, last)
    assert mean_m < first["mtp_loss"][0] - 1.0, (first, last)
    v = summary["final_val"]
    assert v["target_loss"] < first["target_loss"] - 1.0 and v["mtp_loss"] < first["mtp_loss"][0] - 1.0
    assert summary["data"]["vocab_size"] % 8 != 0
    assert summary["acceptance_holdout_zero_shot"]["k1"]["acceptance_length"] >= 1.0


def test_checkpoint_reloads_in_mtpspec_and_transformers(run):
    out, _ = run
    raw = json.load(open(os.path.join(out, "config.json")))
    assert raw["architectures"] == ["Glm4MoeForCausalLM"] and raw["num_nextn_predict_layers"] == 1
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert tok.get_vocab_size() == raw["vocab_size"] and tok.token_to_id("<|endoftext|>") == raw["eos_token_id"]

    from mtpspec.models import load_models
    target, mtp = load_models(out, dtype=torch.float32, device="cpu")
    ids = torch.tensor(tok.encode("Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:").ids)
    pos = torch.arange(len(ids))
    with torch.no_grad():
        h = target(ids, pos)
        ours = target.compute_logits(h)
        m = mtp.compute_logits(mtp(torch.cat([ids[1:], ids[:1]]), pos, h), 0)
    assert torch.isfinite(m).all() and mtp.get_layer(0).shared_head.tied

    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def _mtp_only_config(src: str, out: str, **kw) -> TrainConfig:
    """The fixture model's MTP layer retrained (target frozen, distilled), small and on the CPU."""
    return TrainConfig(output_dir=out, init_from=src, freeze_target=True, mtp_distill=1.0, gsm8k_limit=300,
                       holdout=20, num_synthetic=1500, gsm8k_epochs=1, tokens_per_batch=2048, max_minutes=0,
                       lr=1e-2, warmup_steps=2, log_every=1, accept_prompts=0, device="cpu", dtype="float32",
                       save_dtype="float32", progress=False, distill_fraction=0.0, **kw)


def test_mtp_only_distillation_from_a_checkpoint(run, tmp_path):
    """``--init-from`` + ``--freeze-target`` + ``--mtp-distill``: the target (and the shared
    embedding / head) come back bit-identical, the tokenizer is reused, the MTP layer changes, and
    its distillation loss (cross-entropy to the target's next-position distribution) falls."""
    src, _ = run
    out = str(tmp_path / "phase2")
    cfg = _mtp_only_config(src, out, max_steps=16, eval_every=0, eval_docs=6)
    _train_one_thread(cfg)
    assert open(os.path.join(out, "tokenizer.json")).read() == open(os.path.join(src, "tokenizer.json")).read()
    assert json.load(open(os.path.join(out, "config.json")))["vocab_size"] == json.load(
        open(os.path.join(src, "config.json")))["vocab_size"]
    from mtpspec.models.loader import read_checkpoint_tensors
    before, after = dict(read_checkpoint_tensors(src)), dict(read_checkpoint_tensors(out))
    assert before.keys() == after.keys()
    mtp_prefix = f"model.layers.{json.load(open(os.path.join(src, 'config.json')))['num_hidden_layers']}."
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(k.startswith(mtp_prefix) for k in changed), changed
    recs = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl")) if '"train"' in x]
    first, last = recs[0]["mtp_loss"], [r["mtp_loss"] for r in recs[-4:]]
    assert sum(x[0] for x in last) / 4 < first[0], (first, last)


def test_max_steps_zero_is_no_step_limit(run, tmp_path):
    """``--max-steps 0`` is "no limit" as its help says (a new-user pass: it trained 0 steps and exited
    0): the time budget ends the run, after at least one step."""
    src, _ = run
    cfg = _mtp_only_config(src, str(tmp_path / "timed"), max_steps=0, eval_every=0, eval_docs=0)
    cfg.max_minutes, cfg.reserve_seconds = 0.06, 1.0  # ~2.6 s of training
    summary = _train_one_thread(cfg)
    assert summary["stop_reason"] == "time_budget" and summary["steps"] >= 1, summary


def test_self_distillation_data_is_made_before_the_old_model_goes(run, tmp_path, monkeypatch):
    """A frozen target's self-distillation documents are generated before ``--output-dir``'s earlier
    model is removed: a failure (or an interrupt) there leaves it as it was (a review: the folder
    was emptied first)."""
    from mtpspec.training import train as train_mod
    src, _ = run
    out = tmp_path / "keep"
    out.mkdir()
    files = {"config.json": "{}", "model.safetensors": "old weights", "notes.txt": "mine"}
    for name, text in files.items():
        (out / name).write_text(text)

    def fails(*a, **k):
        raise ValueError("generation failed")
    monkeypatch.setattr(train_mod, "self_distill_data", fails)
    cfg = _mtp_only_config(src, str(out), max_steps=2, eval_every=0, eval_docs=0, overwrite_output_dir=True,
                           self_distill_prompts=4)
    with pytest.raises(ValueError, match="generation failed"):
        _train_one_thread(cfg)
    assert {p.name: p.read_text() for p in out.iterdir()} == files


def test_an_interrupted_run_saves_and_skips_the_final_checks(run, tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM in the loop: the model trained so far is saved, ``stop_reason``
    "interrupted", and the final validation and acceptance estimate are skipped (a scheduler's
    grace period is short; a review found them run in full after the interrupt)."""
    from mtpspec.training import step as step_mod
    src, _ = run
    real, calls = step_mod.forward_loss, []

    def interrupt_at_3(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(step_mod, "forward_loss", interrupt_at_3)
    from mtpspec.training import quick_eval
    monkeypatch.setattr(quick_eval, "validation_metrics", lambda *a, **k: pytest.fail("final validation ran"))
    out = str(tmp_path / "stopped")
    cfg = _mtp_only_config(src, out, max_steps=50, eval_every=0, eval_docs=6)
    cfg.accept_prompts = 1  # (the helper's 0: here the estimate would run, were it not skipped)
    summary = _train_one_thread(cfg)
    assert summary["stop_reason"] == "interrupted" and summary["steps"] == 2, summary
    assert summary["acceptance_holdout_zero_shot"] == {}
    from mtpspec.models import load_models
    load_models(out, dtype=torch.float32, device="cpu")


def test_one_run_with_a_distillation_phase(run, tmp_path):
    """``--distill-fraction``: the first (1 - f) of the budget is the plain recipe (so with the
    fixture's settings and 24 / (1 - 0.25) = 32 steps, the target after phase 1 is bit-identical to
    the fixture's 24-step model), then the target freezes and only the MTP layer trains."""
    src, _ = run
    out = str(tmp_path / "two_phase")
    cfg = TrainConfig(output_dir=out, preset="ci", gsm8k_limit=300, holdout=20, num_synthetic=1500,
                      tokenizer_synthetic=1500, gsm8k_epochs=1, tokens_per_batch=2048, max_steps=32, max_minutes=0,
                      lr=1e-2, warmup_steps=4, log_every=1, eval_every=0, eval_docs=6, accept_prompts=0,
                      device="cpu", dtype="float32", save_dtype="float32", progress=False,
                      distill_fraction=0.25, distill_lr=1e-2, distill_warmup_steps=2, distill_depth=1)
    summary = _train_one_thread(cfg)
    assert summary["distill_phase"]["start_step"] == 24 and summary["steps"] == 32
    recs = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert [r["phase"] for r in train_recs] == [1] * 24 + [2] * 8
    assert all(len(r["mtp_loss"]) == 3 for r in train_recs[:24]) and all(len(r["mtp_loss"]) == 1 for r in train_recs[24:])
    assert train_recs[24]["lr"] == pytest.approx(1e-2 / 2)  # phase 2 restarts its warm-up
    from mtpspec.models.loader import read_checkpoint_tensors
    ref, got = dict(read_checkpoint_tensors(src)), dict(read_checkpoint_tensors(out))
    mtp_prefix = f"model.layers.{json.load(open(os.path.join(src, 'config.json')))['num_hidden_layers']}."
    target_keys = [k for k in ref if not k.startswith(mtp_prefix)]
    assert target_keys and all(torch.equal(ref[k], got[k]) for k in target_keys)
    assert any(not torch.equal(ref[k], got[k]) for k in ref if k.startswith(mtp_prefix))


def test_self_distillation_documents_are_the_models_greedy_completions(run, tmp_path):
    """``--self-distill-prompts``: the documents are ``mtpspec eval gsm8k``'s 5-shot prompt of a
    train question + that model's greedy completion (checked against plain greedy decoding, k = 0,
    of the same prompts), the held-out rows' completions feed ``val_self``, and training on them
    (share 1) changes only the MTP layer."""
    from mtpspec import LLM, SamplingParams
    from mtpspec.data.gsm8k import fewshot_prompt, load_split
    from mtpspec.entrypoints.eval_gsm8k_score import STOP_SEQUENCES
    from mtpspec.training.train import self_distill_data
    src, _ = run
    out = str(tmp_path / "self_distill")
    cfg = _mtp_only_config(src, out, max_steps=6, eval_every=3, eval_docs=2, self_distill_prompts=3,
                           self_distill_share=1.0, self_distill_max_tokens=12, self_distill_seconds=600)
    docs, val_docs, stats = self_distill_data(cfg, torch.device("cpu"), log=lambda m: None)
    assert (len(docs), len(val_docs), stats["prompts_done"]) == (3, 2, 5)  # one engine: 2 held-out + 3
    rows = load_split("train")[:300]
    prompts = [fewshot_prompt(rows[:5], r["question"]) for r in rows[5:8]]
    llm = LLM(model=src, device="cpu", dtype="float32", max_model_len=2048)
    try:
        ref = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, stop=STOP_SEQUENCES), use_tqdm=False)
    finally:
        llm.shutdown()
    for d in range(3):
        want = list(ref[d].prompt_token_ids) + list(ref[d].outputs[0].token_ids)
        assert docs.doc(d).tolist() == want
    # a budget used up at once still runs the first wave (the engine's start-up is not counted)
    from mtpspec.training.self_distill import generate_documents
    seqs, lens, st = generate_documents(src, prompts, 12, 1e-9, {"device": "cpu", "dtype": "float32",
                                                                 "max_model_len": 2048}, wave=2)
    assert st["prompts_done"] == 2 and seqs == [docs.doc(d).tolist() for d in range(2)]
    assert lens == [len(ref[d].prompt_token_ids) for d in range(2)]
    summary = _train_one_thread(cfg)
    assert summary["self_distill"]["documents"] == 3 and summary["final_val_self"]["draft_agreement"] >= 0
    kinds = [json.loads(x)["kind"] for x in open(os.path.join(out, "train_log.jsonl"))]
    assert kinds.count("val_self") == 3  # before step 1, at steps 3 and 6 (the last)
    from mtpspec.models.loader import read_checkpoint_tensors
    before, after = dict(read_checkpoint_tensors(src)), dict(read_checkpoint_tensors(out))
    mtp_prefix = f"model.layers.{json.load(open(os.path.join(src, 'config.json')))['num_hidden_layers']}."
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(k.startswith(mtp_prefix) for k in changed), changed


def test_self_distillation_generated_prompts_follow_the_gsm8k_ones(run, tmp_path):
    """``--self-distill-synthetic M``: after the GSM8K train questions, M generated problems of
    stream ``seed + SELF_DISTILL_STREAM`` (not the training corpus's stream) in the same 5-shot
    prompt, each document that prompt's tokens + a completion, losses from the last prompt position."""
    from tokenizers import Tokenizer

    from mtpspec.data.gsm8k import fewshot_prompt, load_split
    from mtpspec.training.corpus import generate_examples
    from mtpspec.training.train import SELF_DISTILL_STREAM, self_distill_data
    src, _ = run
    cfg = _mtp_only_config(src, str(tmp_path / "sd_gen"), eval_docs=1, self_distill_prompts=1,
                           self_distill_synthetic=2, self_distill_max_tokens=4, self_distill_seconds=600, seed=3)
    docs, val_docs, stats = self_distill_data(cfg, torch.device("cpu"), log=lambda m: None)
    assert (len(docs), len(val_docs), stats["held_out_prompts"], stats["gsm8k_prompts_done"],
            stats["generated_prompts_done"], stats["prompts_done"]) == (3, 1, 1, 1, 2, 4)
    rows = load_split("train")[:300]
    generated = generate_examples(2, 3 + SELF_DISTILL_STREAM)
    assert generated != generate_examples(2, 3)  # not the training corpus's problems
    want = [fewshot_prompt(rows[:5], q) for q in [rows[5]["question"]] + [g["question"] for g in generated]]
    tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    for d in range(3):
        ids = docs.doc(d).tolist()
        n_prompt = int(docs.loss_start[d]) + 1
        assert tok.decode(ids[:n_prompt]) == want[d] and len(ids) > n_prompt


def test_self_distillation_at_phase_two_uses_the_phase_one_target(run, tmp_path):
    """Without ``--freeze-target`` the documents are written when phase 2 freezes the target (from
    the weights phase 1 left, inside the run), and ``val_self`` starts there."""
    out = str(tmp_path / "sd_phase2")
    cfg = TrainConfig(output_dir=out, preset="ci", gsm8k_limit=300, holdout=20, num_synthetic=1500,
                      tokenizer_synthetic=1500, gsm8k_epochs=1, tokens_per_batch=2048, max_steps=8, max_minutes=0,
                      lr=1e-2, warmup_steps=2, log_every=1, eval_every=0, eval_docs=1, accept_prompts=0,
                      device="cpu", dtype="float32", save_dtype="float32", progress=False,
                      distill_fraction=0.5, distill_warmup_steps=1, self_distill_prompts=2,
                      self_distill_share=1.0, self_distill_max_tokens=6, self_distill_seconds=600)
    summary = _train_one_thread(cfg)
    assert summary["distill_phase"]["start_step"] == 4 and summary["self_distill"]["documents"] == 2
    recs = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]
    assert [r["step"] for r in recs if r["kind"] == "val_self"] == [4, 8]


def test_validation_counts_from_loss_start_but_the_mtp_sees_every_token(run):
    """``validation_metrics`` on documents with ``loss_start`` (``val_self``): the draft agreement
    is over positions ``>= loss_start`` only, while the MTP layer's input is every real token (its
    attention reads the prompt). Reference: each document alone through the target and the MTP."""
    import numpy as np

    from mtpspec.layers.attention import build_attention_metadata, set_forward_context
    from mtpspec.models import load_models
    from mtpspec.training.packing import make_batch
    from mtpspec.training.quick_eval import validation_metrics
    from mtpspec.training.self_distill import docs_from_token_lists
    src, _ = run
    target, mtp = load_models(src, dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    vocab = target.config.vocab_size
    seqs = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (60, 47, 64, 52, 58, 49)]
    prompt_lens = [40, 30, 50, 12, 45, 36]
    batch = make_batch(docs_from_token_lists(seqs, 2048, prompt_lens), np.arange(len(seqs)), 0, 2048)
    with torch.no_grad():
        got = validation_metrics(target, mtp, [batch], torch.device("cpu"), 0.6, 1)
        agree = count = 0
        for seq, p in zip(seqs, prompt_lens):
            ids, pos = torch.tensor(seq), torch.arange(len(seq))
            with set_forward_context(build_attention_metadata([len(seq)], [len(seq)], None, device=torch.device("cpu"))):
                hidden = target(ids, pos)
                t_arg = target.compute_logits(hidden).argmax(-1)
                ids1 = torch.cat([ids[1:], torch.zeros(1, dtype=ids.dtype)])
                m_arg = mtp.compute_logits(mtp(ids1, pos, hidden, spec_step_idx=0), 0).argmax(-1)
            rows = range(p - 1, len(seq) - 2)  # loss_start = prompt_len - 1; a row needs token i + 2
            agree += sum(int(m_arg[i] == t_arg[i + 1]) for i in rows)
            count += len(rows)
    assert got["draft_agreement"] == pytest.approx(agree / count, abs=1e-12)

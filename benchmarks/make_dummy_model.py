"""Write a config-only model folder for ``--load-format dummy`` serving benchmarks (issue 17).

``python3 benchmarks/make_dummy_model.py OUT [--preset dense-70b-16l]`` writes ``OUT/config.json`` (a
``Glm4MoeForCausalLM`` config of the preset's width, one MTP layer, the bundled demo tokenizer's
10,007-token vocabulary) and copies the demo tokenizer, so that text prompts (GSM8K) tokenize.
Serve it with ``mtpspec serve --model OUT --load-format dummy``: random weights, real shapes, real
compute; the outputs are noise and the acceptance means nothing.

Presets (per-layer shapes of public models; fewer layers):

* ``dense-70b-16l``: Llama-3-70B's layer (hidden 8,192, 64 query / 8 KV heads of 128, SwiGLU 28,672),
  16 layers + a dense MTP layer: 13.7 B parameters, 27.5 GB in bf16. A 5-shot GSM8K prefill
  (about 800 tokens) is compute-bound (about 22 TFLOP), a 40-token one weight-read-bound.
* ``dense-8b``: Llama-3-8B's shapes (hidden 4,096, 32 / 8 heads, SwiGLU 14,336), 32 layers.
* ``air-8l``: GLM-4.5-Air's MoE layer and vocabulary (151,552), 8 layers + the MTP layer (issue 18's
  speculation-length sweep, with forced acceptance).
* ``cpu-smoke``: tiny, to try the scripts on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

PRESETS = {
    "dense-70b-16l": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=16, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128),
    "dense-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    # GLM-4.5-Air's layer (MoE: 128 experts of 1,408, 8 per token + 1 shared; 96 / 8 heads of 128), 8 layers:
    # the issue-18 step benchmarks' model (bench_engine_step.py), 20 B parameters
    "air-8l": dict(hidden_size=4096, intermediate_size=10944, num_hidden_layers=8, num_attention_heads=96,
                   num_key_value_heads=8, head_dim=128, vocab_size=151552, moe_intermediate_size=1408,
                   n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
                   n_group=1, topk_group=1, attention_bias=True),
    "cpu-smoke": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--preset", default="dense-70b-16l", choices=sorted(PRESETS))
    ap.add_argument("--max-position-embeddings", type=int, default=16384)
    ap.add_argument("--num-hidden-layers", type=int, default=None,
                    help="override the preset's target layer count (e.g. 40 of Llama-3-70B's 80 layers: 34 B "
                         "parameters, 69 GB in bf16, still one H200)")
    args = ap.parse_args()
    if args.num_hidden_layers is not None and args.num_hidden_layers < 1:
        ap.error(f"--num-hidden-layers must be >= 1, got {args.num_hidden_layers}")
    from mtpspec import demo_model_path
    from mtpspec.config import ModelConfig
    demo = demo_model_path("glm4_moe")
    with open(os.path.join(demo, "config.json")) as f:
        raw = json.load(f)
    p = dict(PRESETS[args.preset])
    if args.num_hidden_layers is not None:
        p["num_hidden_layers"] = args.num_hidden_layers
    raw.update(max_position_embeddings=args.max_position_embeddings, partial_rotary_factor=0.5,
               first_k_dense_replace=p["num_hidden_layers"] + 1,  # dense presets: every layer, the MTP layer too
               tie_word_embeddings=False, torch_dtype="bfloat16", num_nextn_predict_layers=1)
    raw.update(p)
    ModelConfig.from_dict(raw)  # validate
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
    shutil.copy(os.path.join(demo, "tokenizer.json"), args.out)
    print(f"wrote {args.out}/config.json ({args.preset}, {p['num_hidden_layers']} layers) and the demo tokenizer")


if __name__ == "__main__":
    main()

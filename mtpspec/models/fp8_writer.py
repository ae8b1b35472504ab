"""Write FP8 block-scaled checkpoints (DeepSeek-V3's ``-FP8`` layout) from float ones, and back.

``python -m mtpspec.models.fp8_writer SRC DST [--block 128 128] [--dequantize]``

:func:`write_fp8_checkpoint` reads a float32 / bfloat16 / float16 checkpoint folder and writes
every linear weight that the released FP8 checkpoints (and ``transformers``'
``FineGrainedFP8Config``, which swaps plain ``nn.Linear`` and expert modules) quantise as
``X.weight`` ``float8_e4m3fn [out, in]`` + ``X.weight_scale_inv`` float32 ``[ceil(out / bn),
ceil(in / bk)]`` (fused experts ``X`` ``[E, out, in]`` + ``X_scale_inv``), by
:func:`mtpspec.ops.fp8_gemm.quantize_weight_blocks` (``scale_inv = amax / 448`` per
``bn x bk`` block; DeepSeek-V3 technical report, arXiv:2412.19437, sec. 3.3), and adds
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [bn, bk]}`` to ``config.json``. Kept as they are (:func:`should_quantize`):
embeddings, ``lm_head`` / MTP ``shared_head.head``, norms, the MoE router ``mlp.gate.weight``
and ``e_score_correction_bias``, the DSA indexer's ``weights_proj`` (DeepSeek-V3.2's reference
code keeps it in the default dtype). Other files of the folder (tokenizer, ...) are copied,
except the model card ``README.md``, which describes the source checkpoint, not this one.
A block dim larger than a weight's dim is one block over that dim (scales ``ceil(out / bn) = 1``
as in the format; memory as for a block of that dim). Every weight is quantised in memory
before anything is written: a failure (e.g. out of memory) leaves no output folder that was not
there before, and no new files in one that was.

:func:`write_dequantized_checkpoint` does the inverse (``float(weight) * scale_inv`` per block,
in float32 or ``dtype``): the reference model the tests compare an FP8 checkpoint against.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mtpspec.memory import is_out_of_memory
from mtpspec.ops.fp8_gemm import DEFAULT_BLOCK, FP8_WEIGHT_DTYPE, dequantize_weight_blocks, quantize_weight_blocks

#: Checkpoint keys never quantised (matched anywhere in the key).
NOT_CONVERTED = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.", "weights_proj", "norm.",
                 "e_score_correction_bias")
#: Fused expert tensors (``transformers`` >= 5 layout), quantised with ``X_scale_inv``.
FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def should_quantize(key: str, tensor: torch.Tensor) -> bool:
    """Whether the writer stores ``key`` as FP8: a 2-D ``*.weight`` of a linear layer, or a 3-D
    fused expert tensor, not in :data:`NOT_CONVERTED`."""
    if any(s in key for s in NOT_CONVERTED):
        return False
    if key.endswith(".weight") and tensor.dim() == 2:
        return True
    return tensor.dim() == 3 and FUSED_EXPERTS.search(key) is not None


def quantization_config(block: Sequence[int] = DEFAULT_BLOCK) -> Dict[str, object]:
    """The ``config.json`` entry of an FP8 checkpoint with ``block``."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(block[0]), int(block[1])]}


def _allocation_error(exc: BaseException, what: str, key: str, shape: Sequence[int],
                      block: Sequence[int]) -> MemoryError:
    """A one-line ``MemoryError`` for an allocation failure ``exc`` while doing ``what`` to ``key``."""
    m = re.search(r"tried to allocate ([0-9]+ bytes|[0-9.]+ ?[KMGT]i?B)", str(exc), re.IGNORECASE)
    asked = ""
    if m:
        amount = m.group(1)
        if amount.endswith("bytes"):
            amount = f"{int(amount.split()[0]) / 2 ** 30:.1f} GiB"
        asked = f" (an allocation of {amount} failed)"
    return MemoryError(
        f"out of memory {what} {key} {list(shape)} with block size {int(block[0])} x {int(block[1])}{asked}; "
        f"expected block sizes like the released checkpoints' 128 x 128 and enough memory for the whole "
        f"checkpoint, which is held in memory until it is written; nothing was written")


def quantize_state_dict(tensors: Dict[str, torch.Tensor], block: Sequence[int] = DEFAULT_BLOCK
                        ) -> Dict[str, torch.Tensor]:
    """``{key: tensor}`` -> the FP8 checkpoint's tensors (quantised weights + ``*_scale_inv``,
    everything else unchanged).

    Raises:
        MemoryError: quantising a weight ran out of memory (one line: the key, its shape, the block).
    """
    out: Dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if should_quantize(key, t):
            try:
                out[key], out[key + "_scale_inv"] = quantize_weight_blocks(t, block)
            except (RuntimeError, MemoryError) as exc:
                if not is_out_of_memory(exc):
                    raise
                raise _allocation_error(exc, "quantising", key, t.shape, block) from None
        else:
            out[key] = t
    return out


def dequantize_state_dict(tensors: Dict[str, torch.Tensor], block: Sequence[int],
                          dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`quantize_state_dict`: every FP8 tensor times its block scales, in ``dtype``.

    Raises:
        MemoryError: dequantising a weight ran out of memory (one line: the key, its shape, the block).
    """
    out: Dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key.endswith("_scale_inv") and key[:-len("_scale_inv")] in tensors:
            continue
        if t.dtype == FP8_WEIGHT_DTYPE:
            try:
                out[key] = dequantize_weight_blocks(t, tensors[key + "_scale_inv"], block[0], block[1], dtype)
            except (RuntimeError, MemoryError) as exc:
                if not is_out_of_memory(exc):
                    raise
                raise _allocation_error(exc, "dequantising", key, t.shape, block) from None
        else:
            out[key] = t
    return out


def _read(src: str) -> Tuple[Dict[str, object], Dict[str, torch.Tensor]]:
    from mtpspec.models.loader import read_checkpoint_tensors
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ValueError(f"no checkpoint at {src!r} (expected a folder with config.json and *.safetensors)")
    with open(os.path.join(src, "config.json"), "r", encoding="utf-8") as f:
        raw = json.load(f)
    return raw, dict(read_checkpoint_tensors(src))


def _copy_other_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        full = os.path.join(src, name)
        if (os.path.isfile(full) and name not in ("config.json", "model.safetensors.index.json", "README.md")
                and not name.endswith(".safetensors")):
            shutil.copy2(full, os.path.join(dst, name))


def _write(src: str, dst: str, tensors: Dict[str, torch.Tensor], raw: Dict[str, object],
           max_shard_bytes: Optional[int] = None) -> List[str]:
    """Copy ``src``'s other files to ``dst`` and save ``tensors`` + ``raw`` there; on a failure,
    remove ``dst`` if this created it, else the files this added (an existing checkpoint's
    weights that :func:`~mtpspec.models.loader.save_checkpoint` replaced are not restored)."""
    from mtpspec.models.loader import save_checkpoint
    existed = os.path.isdir(dst)
    before = set(os.listdir(dst)) if existed else set()
    try:
        _copy_other_files(src, dst)
        return save_checkpoint(dst, tensors, raw, max_shard_bytes=max_shard_bytes)
    except BaseException:
        if not existed:
            shutil.rmtree(dst, ignore_errors=True)
        elif os.path.isdir(dst):
            for name in set(os.listdir(dst)) - before:
                full = os.path.join(dst, name)
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full, ignore_errors=True)
                else:
                    try:
                        os.remove(full)
                    except OSError:
                        pass
        raise


def write_fp8_checkpoint(src: str, dst: str, block: Sequence[int] = DEFAULT_BLOCK,
                         max_shard_bytes: Optional[int] = None) -> List[str]:
    """Write ``src`` (a float checkpoint folder) as an FP8 block-scaled checkpoint to ``dst``.

    Args:
        src, dst: checkpoint folders (``dst`` created; may not be ``src``).
        block: ``(block_n, block_k)``, ``(128, 128)`` as the released checkpoints.
        max_shard_bytes: shard the output (see :func:`mtpspec.models.loader.save_checkpoint`).

    Every weight is quantised in memory before ``dst`` is touched; a failure leaves no ``dst``
    that did not exist before (and no new files in one that did).

    Returns:
        The files written.

    Raises:
        ValueError: ``src`` is not a checkpoint or already holds FP8 weights, ``dst`` is ``src``,
            or a block size is not an int >= 1 (a block larger than a weight is fine: one block
            over that dim).
        MemoryError: quantising a weight ran out of memory (nothing written).
    """
    if len(block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block):
        raise ValueError(f"block sizes must be two ints >= 1, got {list(block)!r}")
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ValueError("write_fp8_checkpoint: dst must differ from src")
    raw, tensors = _read(src)
    if raw.get("quantization_config") is not None or any(t.dtype == FP8_WEIGHT_DTYPE for t in tensors.values()):
        raise ValueError(f"write_fp8_checkpoint: {src!r} is already quantised")
    raw = dict(raw, quantization_config=quantization_config(block))
    quantised = quantize_state_dict(tensors, block)
    del tensors
    return _write(src, dst, quantised, raw, max_shard_bytes)


def write_dequantized_checkpoint(src: str, dst: str, dtype: torch.dtype = torch.float32) -> List[str]:
    """Write an FP8 checkpoint ``src`` as a plain one (weights dequantised to ``dtype``, no
    ``quantization_config``) to ``dst``. Like :func:`write_fp8_checkpoint`, every weight is
    dequantised in memory before ``dst`` is touched.

    Raises:
        ValueError: ``src`` is not an FP8 block-scaled checkpoint.
        MemoryError: dequantising a weight ran out of memory (nothing written).
    """
    from mtpspec.config import Fp8WeightConfig
    raw, tensors = _read(src)
    q = Fp8WeightConfig.from_dict(raw.get("quantization_config"))
    if q is None:
        raise ValueError(f"write_dequantized_checkpoint: {src!r} has no quantization_config")
    raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    dequantised = dequantize_state_dict(tensors, q.weight_block_size, dtype)
    del tensors
    return _write(src, dst, dequantised, raw)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; errors are ``error: <message>`` on stderr and exit status 2."""
    p = argparse.ArgumentParser(prog="python -m mtpspec.models.fp8_writer", description=__doc__.split("\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--block", type=int, nargs=2, default=list(DEFAULT_BLOCK), metavar=("BLOCK_N", "BLOCK_K"))
    p.add_argument("--dequantize", action="store_true", help="write SRC (FP8) as a float32 checkpoint instead")
    p.add_argument("--max-shard-bytes", type=int, default=None)
    a = p.parse_args(argv)
    try:
        files = (write_dequantized_checkpoint(a.src, a.dst) if a.dequantize
                 else write_fp8_checkpoint(a.src, a.dst, tuple(a.block), a.max_shard_bytes))
    except (ValueError, OSError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"dst": a.dst, "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

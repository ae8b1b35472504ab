"""Load checkpoints (Hugging Face safetensors layout) into TP-sharded models; write them.

Architecture-agnostic: the model classes and the checkpoint layout come from
:mod:`mtpspec.models.registry` (each architecture's weight-spec functions map every checkpoint
key to a :class:`~mtpspec.models.interfaces.WeightSpec`; e.g. GLM-4.5's layout is described in
:mod:`mtpspec.models.glm4_moe` and :mod:`mtpspec.models.glm4_moe_mtp`). Here: reading
(:class:`CheckpointReader`), checking a checkpoint against the specs, loading through each
parameter's ``weight_loader``, writing (:func:`save_checkpoint`, :func:`export_hf_state_dict`)
and the errors.

Loading reads one tensor at a time (``safe_open`` per file, lazily per key) and hands the full
tensor to the parameter's ``weight_loader``, which keeps this rank's shard, converted to the
requested dtype. Every key is checked against the config before any tensor is read (names,
shapes, dtypes, from the headers only); the model is built fresh and returned only when every
parameter has been loaded, so a failed load never leaves a half-loaded model behind.

FP8 checkpoints (``quantization_config.quant_method == "fp8"``: DeepSeek-V3 / V3.2, GLM-4.5 /
GLM-5 ``-FP8``; :class:`~mtpspec.config.Fp8WeightConfig`): an ``F8_E4M3`` weight ``X.weight``
comes with its float32 block scales ``X.weight_scale_inv`` (fused experts: ``X_scale_inv``).
The models are built inside :func:`~mtpspec.layers.fp8.fp8_weights`, so their linear layers and
experts keep the weights as FP8 plus scales (:mod:`mtpspec.layers.fp8`); layers the checkpoint
stores unquantised are turned back into plain ones first; an FP8 tensor for a parameter that
stays in the model dtype (``kv_b_proj``, and any other) is dequantised on load; a float tensor
for an FP8 layer whose other tensors are FP8 is block-quantised on load. Errors: an FP8 weight
without its scales (:class:`MissingKeyError` naming the scale tensor), scales of the wrong shape
(:class:`ShapeMismatchError`), FP8 tensors without ``quantization_config``
(:class:`UnsupportedDtypeError`), shards that cut weight blocks (``CheckpointError`` naming the
tensor, the layer, the size and tp).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from mtpspec.config import LOAD_FORMATS, ModelConfig
from mtpspec.distributed import get_tensor_model_parallel_world_size, get_tp_group
from mtpspec.layers.fp8 import fp8_weights
from mtpspec.layers.fused_moe import FusedMoE
from mtpspec.models.interfaces import WeightSpec
from mtpspec.models.registry import get_architecture
from mtpspec.ops.fp8_gemm import FP8_WEIGHT_DTYPE, dequantize_weight_blocks, quantize_weight_blocks, scale_grid

logger = logging.getLogger(__name__)
SUPPORTED_LOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
#: The safetensors name of FP8 weights (with ``quantization_config`` only).
FP8_FILE_DTYPE = "F8_E4M3"
#: What an FP8 weight's block scales are called: ``X.weight`` -> ``X.weight_scale_inv``, else ``X`` -> ``X_scale_inv``.
SCALE_SUFFIX = "_scale_inv"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: What FP8 (or otherwise quantized) checkpoints hold beside the weights: DeepSeek-V3's block scales
#: (``*.weight_scale_inv``), compressed-tensors' ``*.weight_scale`` / ``*.input_scale``.
QUANT_SCALE_SUFFIXES = ("_scale_inv", ".weight_scale", ".input_scale")
QUANTIZED_HINT = ("quantized checkpoints other than FP8 block-scaled ones (quantization_config quant_method 'fp8' "
                  "with weight_block_size) are not supported; convert the weights to bfloat16 first")


def scale_key_of(key: str) -> str:
    """The block-scale tensor of FP8 weight ``key`` (``X.weight`` -> ``X.weight_scale_inv``)."""
    return key + SCALE_SUFFIX


# ------------------------------------------------------------------------------------------- errors
class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (base class of the errors below)."""


class MissingKeyError(CheckpointError):
    """A tensor the model needs is not in the checkpoint (``.key`` names it)."""

    def __init__(self, key: str, detail: str = ""):
        super().__init__(f"checkpoint is missing key {key!r}{detail}")
        self.key = key


class UnexpectedKeyError(CheckpointError):
    """The checkpoint holds a tensor the model does not know (``.key`` names it)."""

    def __init__(self, key: str, detail: str = ""):
        super().__init__(f"checkpoint has unexpected key {key!r}{detail}")
        self.key = key


class ShapeMismatchError(CheckpointError):
    """A tensor's shape differs from what the config implies (``.key``, ``.expected``, ``.actual``)."""

    def __init__(self, key: str, expected: Sequence[int], actual: Sequence[int]):
        super().__init__(f"checkpoint tensor {key!r}: expected shape {list(expected)}, got {list(actual)}")
        self.key, self.expected, self.actual = key, tuple(expected), tuple(actual)


class UnsupportedDtypeError(CheckpointError):
    """A tensor (or the requested load dtype) is not float32 / bfloat16 / float16."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, has a broken header, is missing, or disagrees with the index."""


# ------------------------------------------------------------------------------------------- reading
class CheckpointReader:
    """Lazy access to the tensors of a safetensors checkpoint folder.

    Finds ``model.safetensors.index.json`` (sharded), else ``model.safetensors``, else every
    ``*.safetensors`` file in the folder. Headers are read on open; tensor data only on
    :meth:`get`. Use as a context manager (closes the files).

    Raises:
        FileNotFoundError: no safetensors file in the folder.
        CorruptCheckpointError: a truncated / unreadable file, an index naming a missing file or
            a key its file does not hold, invalid index JSON, a key in two files.
    """

    def __init__(self, path: str):
        from safetensors import safe_open
        self.path = path
        self._stack = contextlib.ExitStack()
        self._files: Dict[str, Any] = {}
        self._where: Dict[str, str] = {}
        index_path = os.path.join(path, INDEX_FILE)
        try:
            if os.path.isfile(index_path):
                try:
                    with open(index_path, "r", encoding="utf-8") as f:
                        weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise CorruptCheckpointError(f"{index_path}: not a valid safetensors index ({exc})") from exc
                files = sorted(set(weight_map.values()))
            elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
                weight_map, files = None, [SINGLE_FILE]
            else:
                files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
                weight_map = None
                if not files:
                    raise FileNotFoundError(f"no safetensors checkpoint in {path!r}")
            for name in files:
                full = os.path.join(path, name)
                if not os.path.isfile(full):
                    raise CorruptCheckpointError(f"checkpoint file {full!r} (named by the index) does not exist")
                try:
                    handle = self._stack.enter_context(safe_open(full, framework="pt", device="cpu"))
                except Exception as exc:  # safetensors raises SafetensorError (not exported) or OSError
                    raise CorruptCheckpointError(f"checkpoint file {full!r} is truncated or corrupt: {exc}") from exc
                self._files[name] = handle
                for key in handle.keys():
                    if weight_map is None:
                        if key in self._where:
                            raise CorruptCheckpointError(f"key {key!r} is in both {self._where[key]} and {name}")
                        self._where[key] = name
            if weight_map is not None:
                held = {name: set(handle.keys()) for name, handle in self._files.items()}
                for key, name in weight_map.items():
                    if key not in held[name]:
                        raise CorruptCheckpointError(f"index maps {key!r} to {name}, which does not hold it")
                    self._where[key] = name
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def keys(self) -> List[str]:
        return sorted(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self._files[self._where[key]].get_slice(key).get_shape())

    def dtype_name(self, key: str) -> str:
        """The safetensors dtype string, e.g. ``"BF16"``."""
        return self._files[self._where[key]].get_slice(key).get_dtype()

    def get(self, key: str) -> torch.Tensor:
        """Read one full tensor (CPU).

        Raises:
            CorruptCheckpointError: its bytes cannot be read.
        """
        try:
            return self._files[self._where[key]].get_tensor(key)
        except Exception as exc:
            raise CorruptCheckpointError(f"cannot read {key!r} from {self._where[key]}: {exc}") from exc


def _differs_from(reader: CheckpointReader, key: str, source: str) -> bool:
    """Whether checkpoint tensor ``key`` (e.g. a tied config's ``lm_head.weight``) differs from the
    tensor ``source`` it is tied to (both read whole; only a tied checkpoint that stores both pays it)."""
    return source not in reader or not torch.equal(reader.get(key), reader.get(source))


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")  # a decoder layer's tensor (target or MTP), its index


def _num_known_layers(*specs: Dict[str, WeightSpec]) -> Optional[int]:
    """One more than the highest ``model.layers.N.`` index among the specs (target and MTP layers), or
    ``None`` where none is named so."""
    ids = [int(m.group(1)) for d in specs for key in d if (m := _LAYER_KEY.match(key))]
    return max(ids) + 1 if ids else None


def _select(reader: CheckpointReader, own: Dict[str, WeightSpec], other: Dict[str, WeightSpec],
            part: str, block: Optional[Tuple[int, int]] = None) -> Dict[str, WeightSpec]:
    """Check names, layouts, shapes and dtypes (FP8 weights and their scales with ``block``); return
    the keys of ``own`` to load."""
    for key in reader.keys():
        if key not in own and key not in other:
            base = key[:-len(SCALE_SUFFIX)] if key.endswith(SCALE_SUFFIX) else None
            if block is not None and base is not None and (base in own or base in other):
                if base not in reader or reader.dtype_name(base) != FP8_FILE_DTYPE:
                    raise UnexpectedKeyError(key, f" (block scales of {base!r}, which is not stored as FP8)")
                continue
            if key.endswith(QUANT_SCALE_SUFFIXES):
                raise UnexpectedKeyError(key, f" (a quantization scale: {QUANTIZED_HINT})")
            layer = _LAYER_KEY.match(key)
            n_known = _num_known_layers(own, other)
            if layer and n_known is not None and int(layer.group(1)) >= n_known:
                raise UnexpectedKeyError(key, f" (layer {layer.group(1)} is past the {n_known} that config.json "
                                              "declares, num_hidden_layers + num_nextn_predict_layers: the two must "
                                              "count the checkpoint's target and MTP layers; an MTP layer past "
                                              "the target's is counted by num_nextn_predict_layers)")
            raise UnexpectedKeyError(key, f" (not a tensor of this {part}'s config; expected names like "
                                          f"{next(iter(own))!r})")
    layouts: Dict[str, Dict[str, List[str]]] = {}
    for key, spec in own.items():
        if spec.layout is not None:
            group, kind = spec.layout.rsplit(":", 1)
            layouts.setdefault(group, {}).setdefault(kind, []).append(key)
    chosen: Set[str] = set()
    for group, kinds in layouts.items():
        present = {kind: [k for k in keys if k in reader] for kind, keys in kinds.items()}
        full = [kind for kind, keys in kinds.items() if len(present[kind]) == len(keys)]
        any_present = [kind for kind in kinds if present[kind]]
        if len(any_present) > 1:
            raise UnexpectedKeyError(present["fused"][0], f" ({group} is stored both per expert and fused)")
        kind = any_present[0] if any_present else "per_expert"
        if kind not in full:
            missing = next(k for k in kinds[kind] if k not in reader)
            raise MissingKeyError(missing)
        chosen.update(kinds[kind])
    selected: Dict[str, WeightSpec] = {}
    for key, spec in own.items():
        if spec.layout is not None and key not in chosen:
            continue
        if key not in reader:
            if spec.optional:
                continue
            raise MissingKeyError(key)
        dt = reader.dtype_name(key)
        if dt == FP8_FILE_DTYPE and block is not None and len(spec.shape) >= 2:
            sk = scale_key_of(key)
            if sk not in reader:
                raise MissingKeyError(sk, f" (the FP8 weight {key!r} needs its block scales)")
            if reader.dtype_name(sk) not in SUPPORTED_FILE_DTYPES:
                raise UnsupportedDtypeError(f"checkpoint tensor {sk!r} has unsupported dtype {reader.dtype_name(sk)}; "
                                            "block scales must be float32 (or another float)")
            if reader.shape(sk) != scale_grid(spec.shape, block):
                raise ShapeMismatchError(sk, scale_grid(spec.shape, block), reader.shape(sk))
        elif dt not in SUPPORTED_FILE_DTYPES:
            hint = f" ({QUANTIZED_HINT})" if dt.startswith(("F8", "I8", "U8")) else ""
            if dt == FP8_FILE_DTYPE and block is None:
                hint = (" (an FP8 tensor, but config.json has no quantization_config with quant_method 'fp8' and "
                        "weight_block_size; quantized (e.g. FP8) checkpoints need it)")
            raise UnsupportedDtypeError(f"checkpoint tensor {key!r} has unsupported dtype {dt}; "
                                        f"expected one of {sorted(SUPPORTED_FILE_DTYPES)}{hint}")
        shape = reader.shape(key)
        if shape != spec.shape:
            raise ShapeMismatchError(key, spec.shape, shape)
        if not spec.ignored:
            selected[key] = spec
        elif spec.tied_to is not None and _differs_from(reader, key, spec.tied_to):
            # a new-user pass (2026-12-05): the swap was silent; an identical copy (e.g. converted from
            # .bin files) changes nothing and is not worth a word (transformers warns only on a difference)
            logger.warning("the checkpoint's %r, which differs from %s it is tied to by config.json "
                           "(tie_word_embeddings), is not loaded: %s is used in its place (as vLLM ties it; "
                           "transformers keeps a differing lm_head); set tie_word_embeddings false to use it",
                           key, spec.tied_to, spec.tied_to)
    return selected


def _check_mtp_layers_present(reader: CheckpointReader, cfg: ModelConfig, m_specs: Dict[str, WeightSpec],
                              model_path: str) -> None:
    """Raise MissingKeyError naming the whole MTP layer when ``config.json`` declares it but the
    checkpoint holds no tensor of it (``transformers``' ``save_pretrained`` writes no MTP layers,
    yet ``DeepseekV3Config`` declares one by default), rather than the first missing tensor."""
    n = cfg.num_nextn_predict_layers
    for k in range(n):
        prefix = f"model.layers.{cfg.num_hidden_layers + k}."
        keys = [key for key in m_specs if key.startswith(prefix)]
        if keys and not any(key in reader for key in keys):
            first = next((key for key in keys if not m_specs[key].optional), keys[0])
            if k == 0:
                way_out = ("transformers' save_pretrained does not write MTP layers; add the MTP weights, or run "
                           "without speculative decoding: -k 0, speculative_config=None")
            else:
                way_out = f"it holds {k}: set num_nextn_predict_layers={k} in config.json, or add the missing layers"
            raise MissingKeyError(first, f" (config.json declares num_nextn_predict_layers={n}, but {model_path} "
                                         f"holds no tensor of MTP layer {k}: nothing under {prefix!r}; {way_out})")


def _unquantize_plain_layers(model: nn.Module, reader: CheckpointReader, specs: Dict[str, WeightSpec]) -> None:
    """Turn FP8-built layers into plain ones where the checkpoint stores none of their weights as
    FP8 (``modules_to_not_convert``, or a layer the writer kept in bf16)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    by_module: Dict[str, List[str]] = {}
    for key, spec in specs.items():
        if spec.param + SCALE_SUFFIX in params and key in reader:
            by_module.setdefault(spec.param.rsplit(".", 1)[0], []).append(key)
    for mod_name, keys in by_module.items():
        if not any(reader.dtype_name(k) == FP8_FILE_DTYPE for k in keys):
            model.get_submodule(mod_name).unquantize()


def _load_selected(module: nn.Module, reader: CheckpointReader, selected: Dict[str, WeightSpec],
                   shared: Sequence[torch.Tensor], check_finite: bool,
                   block: Optional[Tuple[int, int]] = None) -> None:
    """Load every selected tensor (FP8 ones with their block scales) and check that no parameter
    of ``module`` was left unloaded."""
    params = dict(module.named_parameters(remove_duplicate=False))
    shared_ids = {id(t) for t in shared}
    loaded: Set[int] = set()

    def feed(param: torch.Tensor, tensor: torch.Tensor, spec: WeightSpec) -> None:
        if spec.shard_id in ("w1", "w3", "w13", "w2"):  # FusedMoE: (param, w, shard_id, expert_id)
            param.weight_loader(param, tensor, spec.shard_id, spec.expert_id)
        else:
            param.weight_loader(param, tensor, spec.shard_id)

    for key, spec in selected.items():
        if spec.param not in params:
            raise CheckpointError(f"internal: {key!r} maps to unknown parameter {spec.param!r}")
        param = params[spec.param]
        tensor = reader.get(key)
        scale_param = params.get(spec.param + SCALE_SUFFIX)
        scale = None
        if tensor.dtype == FP8_WEIGHT_DTYPE:
            scale = reader.get(scale_key_of(key)).float()
            if scale_param is None:  # a parameter kept in the model dtype (kv_b_proj, ...): dequantise once
                tensor, scale = dequantize_weight_blocks(tensor, scale, block[0], block[1]), None
        elif scale_param is not None and tensor.dim() >= 2:  # float weight of an FP8 layer: quantise on load
            tensor, scale = quantize_weight_blocks(tensor, block)
        if check_finite:
            finite = tensor.float() if tensor.dtype == FP8_WEIGHT_DTYPE else tensor
            if not bool(torch.isfinite(finite).all()) or (scale is not None and not bool(torch.isfinite(scale).all())):
                raise CorruptCheckpointError(f"checkpoint tensor {key!r} holds NaN or infinite values")
        try:
            feed(param, tensor, spec)
            if scale is not None:
                feed(scale_param, scale, spec)
                loaded.add(id(scale_param))
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"loading {key!r} into {spec.param}: {exc}") from exc
        loaded.add(id(param))
    for name, p in params.items():
        if id(p) not in loaded and id(p) not in shared_ids:
            # A parameter no checkpoint tensor fed (would hold uninitialised memory).
            raise MissingKeyError(name, " (no checkpoint tensor loads this parameter)")


# ------------------------------------------------------------------------------------------- building
def _resolve(dtype: Optional[Union[torch.dtype, str]], device: Optional[Union[str, torch.device]],
             cfg: ModelConfig) -> Tuple[torch.dtype, torch.device]:
    from mtpspec.config import ModelConfigError, _dtype_from_name
    if dtype is None or dtype == "auto":  # the checkpoint's (vLLM's "auto")
        dtype = cfg.dtype or torch.float32
    try:
        dtype = _dtype_from_name(dtype)
    except ModelConfigError as exc:
        raise UnsupportedDtypeError(f"unsupported load dtype {dtype!r}; expected auto (the checkpoint's), "
                                    "float32, bfloat16 or float16") from exc
    dev = torch.device(device) if device is not None else get_tp_group().device
    return dtype, dev


#: While :func:`sharing_weights` is active: name -> parameter of the models loaded so far (see there).
_SHARED_WEIGHTS: Optional[Dict[str, torch.Tensor]] = None


@contextlib.contextmanager
def sharing_weights(registry: Dict[str, torch.Tensor]) -> Iterator[None]:
    """Within, :func:`load_models` makes the models it builds share parameters with the earlier loads
    recorded in ``registry`` (a dict the caller keeps across calls, e.g. for several engines of one
    model in one process: ``bench arms --in-process``): after each load, every parameter whose
    name (qualified by the checkpoint folder, load format, dtype, device, TP rank and shared-experts
    fusion), shape, dtype and values equal a recorded one's is replaced by that tensor (the new copy
    is freed), and the others are recorded. Values are compared (``torch.equal``), so sharing never
    changes what a model computes; only the memory of identical weights is held once. Parameters
    only (buffers and caches stay per model). The registry keeps the tensors alive until the caller
    clears it (an engine's shutdown releases only its own references). Loads in other processes
    (spawned TP ranks) do not see it. Not thread-safe; one registry at a time."""
    global _SHARED_WEIGHTS
    prev, _SHARED_WEIGHTS = _SHARED_WEIGHTS, registry
    try:
        yield
    finally:
        _SHARED_WEIGHTS = prev


def _share_weights(key: str, models: Sequence[Tuple[str, Optional[nn.Module]]]) -> None:
    """Replace the parameters of ``models`` (prefix, model) by equal ones of :data:`_SHARED_WEIGHTS`
    (recording the rest). No-op outside :func:`sharing_weights`."""
    reg = _SHARED_WEIGHTS
    if reg is None:
        return
    with torch.no_grad():
        for prefix, model in models:
            if model is None:
                continue
            for mod_name, mod in model.named_modules():
                for pname, p in list(mod._parameters.items()):
                    if p is None:
                        continue
                    name = f"{key}|{prefix}.{mod_name}.{pname}"
                    old = reg.get(name)
                    if old is p:
                        continue
                    if (old is not None and old.shape == p.shape and old.dtype == p.dtype and old.device == p.device
                            and type(old) is type(p) and torch.equal(old, p)):
                        mod._parameters[pname] = old
                    else:
                        reg[name] = p


def load_models(model_path: str, dtype: Optional[Union[torch.dtype, str]] = None,
                device: Optional[Union[str, torch.device]] = None, load_mtp: bool = True,
                fuse_allreduce_rmsnorm: bool = True, sequence_parallel: bool = False,
                check_finite: bool = True, config: Optional[ModelConfig] = None, load_format: str = "auto",
                fuse_shared_experts: bool = False):
    """Build the target (and the MTP draft model) from a checkpoint folder, sharded for this rank.

    Call on every TP rank (after ``init_distributed_environment`` / inside ``launch``); each
    rank keeps only its shards.

    Args:
        model_path: folder with ``config.json`` and safetensors files.
        dtype: parameter dtype (float32 / bfloat16 / float16 or their names); default the
            config's ``torch_dtype``. The router always stays float32.
        device: default the TP group's device (``cuda:{local_rank}`` under NCCL, else CPU).
        load_mtp: also build the MTP model (needs ``num_nextn_predict_layers >= 1``).
        fuse_allreduce_rmsnorm, sequence_parallel: the MTP tail variant.
        check_finite: reject tensors holding NaN / inf.
        config: an already-read config (default: read ``config.json``).
        load_format: ``"auto"`` / ``"safetensors"``: the checkpoint's weights; ``"dummy"``: no
            weights are read (the folder needs only ``config.json``): every parameter is drawn
            from U(-1e-3, 1e-3) as vLLM's dummy format does (:func:`initialize_dummy_weights`),
            MTP heads tied to the target's; for benchmarks of shapes without a checkpoint.
        fuse_shared_experts: after loading, move each MoE's shared experts into its routed
            experts (``fuse_shared_experts()`` of the MoE modules; the engine's default, off with
            ``--disable-shared-experts-fusion``); off here so that the modules keep the
            checkpoint's layout (training saves them back).

    Returns:
        ``(target, mtp or None)``, both in eval mode, of the classes the registry names for the
        config's architecture (e.g. ``Glm4MoeForCausalLM``, ``Glm4MoeMTP``).

    Raises:
        ModelConfigError: bad config or one that cannot be split over the current tp.
        ValueError: an unknown ``load_format``.
        MissingKeyError / UnexpectedKeyError / ShapeMismatchError / UnsupportedDtypeError /
        CorruptCheckpointError: see their docstrings.
    """
    cfg = config or ModelConfig.from_pretrained(model_path)
    cfg.verify_tensor_parallel(get_tensor_model_parallel_world_size())
    dtype, dev = _resolve(dtype, device, cfg)
    if load_mtp and cfg.num_nextn_predict_layers < 1:
        raise CheckpointError(f"{model_path}: config declares no MTP layers (num_nextn_predict_layers = 0)")
    arch = get_architecture(cfg.architecture)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "dummy":
        block = tuple(cfg.quantization.weight_block_size) if cfg.quantization is not None else None
        with torch.device(dev), fp8_weights(block):
            target = arch.target_class()(cfg, dtype)
            mtp = arch.mtp_class()(cfg, target.get_input_embeddings(), target.lm_head, True, fuse_allreduce_rmsnorm,
                                   sequence_parallel, dtype) if load_mtp else None
        initialize_dummy_weights(target)
        if mtp is not None:
            initialize_dummy_weights(mtp, skip=list(target.parameters()))
        if fuse_shared_experts:
            _fuse_shared_experts(target, mtp)
        _share_weights(_share_key(model_path, load_format, dtype, dev, fuse_shared_experts),
                       [("t", target), ("m", mtp)])
        return target.eval(), None if mtp is None else mtp.eval()
    t_specs, m_specs = arch.target_weight_specs(cfg), arch.mtp_weight_specs(cfg)
    block = tuple(cfg.quantization.weight_block_size) if cfg.quantization is not None else None
    with CheckpointReader(model_path) as reader:
        t_sel = _select(reader, t_specs, m_specs, "target", block)
        if load_mtp:
            _check_mtp_layers_present(reader, cfg, m_specs, model_path)
        m_sel = _select(reader, m_specs, t_specs, "MTP model", block) if load_mtp else {}
        with torch.device(dev), fp8_weights(block):
            target = arch.target_class()(cfg, dtype)
        if block is not None:
            _unquantize_plain_layers(target, reader, t_sel)
        _load_selected(target, reader, t_sel, (), check_finite, block)
        mtp = None
        if load_mtp:
            ties = [key not in reader for key, spec in m_specs.items() if spec.tied_head]
            with torch.device(dev), fp8_weights(block):
                mtp = arch.mtp_class()(cfg, target.get_input_embeddings(), target.lm_head, ties,
                                       fuse_allreduce_rmsnorm, sequence_parallel, dtype)
            if block is not None:
                _unquantize_plain_layers(mtp, reader, m_sel)
            _load_selected(mtp, reader, m_sel, list(target.parameters()), check_finite, block)
            mtp.eval()
    if fuse_shared_experts:
        _fuse_shared_experts(target, mtp)
    _share_weights(_share_key(model_path, load_format, dtype, dev, fuse_shared_experts), [("t", target), ("m", mtp)])
    return target.eval(), mtp


def _share_key(model_path: str, load_format: str, dtype: torch.dtype, dev: Any, fuse: bool) -> str:
    """What must match for two loads' parameters to be shared (:func:`sharing_weights`), besides names."""
    tp = get_tp_group()
    return (f"{os.path.realpath(model_path)}|{load_format}|{dtype}|{torch.device(dev)}|"
            f"{tp.rank_in_group}/{tp.world_size}|{fuse}")


def _fuse_shared_experts(*models: Optional[nn.Module]) -> int:
    """``fuse_shared_experts()`` on every module of ``models`` that has it; returns how many fused."""
    mods = [m for model in models if model is not None for m in model.modules() if hasattr(m, "fuse_shared_experts")]
    fused = sum(bool(m.fuse_shared_experts()) for m in mods)
    if fused < len(mods):  # FP8 (or mixed-dtype) experts keep their shared MLP: say so once
        logger.info("shared experts fused into the routed experts in %d of %d MoE layers (the others hold FP8 or "
                    "mixed-dtype expert weights, which are not fused)", fused, len(mods))
    return fused


@torch.no_grad()
def initialize_dummy_weights(module: nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234,
                             skip: Sequence[torch.Tensor] = ()) -> None:
    """Fill every floating parameter of ``module`` in place with U(low, high) (vLLM's
    ``initialize_dummy_weights``): deterministic, each parameter from its own generator (on the
    parameter's device) seeded by ``seed`` and its name, so replicated parameters agree across
    tensor-parallel ranks (a sharded
    one holds the same values on every rank). Parameters in ``skip`` (e.g. the target's, shared
    by the MTP model through tied heads) are left as they are."""
    import zlib
    skipped = {id(p) for p in skip}
    for name, p in module.named_parameters():
        if not p.is_floating_point() or id(p) in skipped:
            continue
        if name.endswith(SCALE_SUFFIX):  # FP8 block scales: weights below span [low, high]
            p.fill_(max(abs(low), abs(high)) / 448.0)
            continue
        g = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
        if p.dtype == FP8_WEIGHT_DTYPE:
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(-448.0, 448.0, generator=g).to(p.dtype))
            continue
        p.uniform_(low, high, generator=g)


def load_target_model(model_path: str, dtype: Optional[Union[torch.dtype, str]] = None,
                      device: Optional[Union[str, torch.device]] = None, check_finite: bool = True):
    """Only the target: :func:`load_models` with ``load_mtp=False``; returns the model."""
    return load_models(model_path, dtype, device, load_mtp=False, check_finite=check_finite)[0]


# ------------------------------------------------------------------------------------------- writing
def _extract(param: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """The full checkpoint tensor of ``spec`` from a tp-1 parameter (inverse of the loaders)."""
    if spec.expert_id is not None:
        param = param[spec.expert_id]
    if spec.rows is not None:
        return param[spec.rows[0]:spec.rows[1]]
    return param[:spec.shape[0]] if param.shape[0] != spec.shape[0] else param


def export_hf_state_dict(target: Optional[nn.Module] = None, mtp: Optional[nn.Module] = None,
                         dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """The Hugging Face checkpoint tensors of tp-1 mtpspec models (per-expert expert layout), by
    the weight specs the registry names for each model's ``config.architecture``.

    Args:
        target: a target model, e.g. ``Glm4MoeForCausalLM`` (or None).
        mtp: an MTP model, e.g. ``Glm4MoeMTP`` (or None); tied heads and the shared embedding
            are not exported.
        dtype: convert to this dtype (default: keep each parameter's dtype).

    Returns:
        ``{key: CPU tensor}``, ready for :func:`save_checkpoint`.

    Raises:
        ValueError: the models were built at tp > 1 (gather the shards first), hold FP8 weights
            (export the float checkpoint and convert it with :mod:`mtpspec.models.fp8_writer`), or
            had their shared experts fused into the routed ones (``load_models(...,
            fuse_shared_experts=True)``, the engine's default: load without it to export).
        ModelConfigError: a model's architecture is not registered.
    """
    if get_tensor_model_parallel_world_size() != 1:
        raise ValueError("export_hf_state_dict needs tp-1 models (every shard is the full tensor)")
    for model in (target, mtp):
        if model is not None and any(isinstance(m, FusedMoE) and m.num_shared_fused for m in model.modules()):
            raise ValueError("export_hf_state_dict: the model's shared experts are fused into its routed experts "
                             "(load_models(..., fuse_shared_experts=True)); load it without fusion to export it")
        if model is not None and any(p.dtype == FP8_WEIGHT_DTYPE for p in model.parameters()):
            raise ValueError("export_hf_state_dict: the model holds FP8 block-scaled weights; export a float model "
                             "and convert it with mtpspec.models.fp8_writer")
    out: Dict[str, torch.Tensor] = {}
    for model, role in ((target, "target"), (mtp, "mtp")):
        if model is None:
            continue
        cfg = model.config
        arch = get_architecture(cfg.architecture)
        specs = arch.target_weight_specs(cfg) if role == "target" else arch.mtp_weight_specs(cfg)
        tied = iter(getattr(model, "tie_heads", ()))
        params = dict(model.named_parameters(remove_duplicate=False))
        for key, spec in specs.items():
            if spec.tied_head and next(tied, False):
                continue
            if spec.ignored or (spec.layout or "").endswith(":fused") or spec.param not in params:
                continue
            t = _extract(params[spec.param].detach(), spec)
            out[key] = t.to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()
    return out


def save_checkpoint(path: str, tensors: Mapping[str, torch.Tensor], config: Optional[Mapping[str, Any]] = None,
                    max_shard_bytes: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> List[str]:
    """Write tensors in the Hugging Face safetensors layout.

    Args:
        path: output folder (created). Existing ``model*.safetensors`` files and the index in it
            are removed first, so stale shards never mix with the new ones.
        tensors: ``{checkpoint key: tensor}`` (any device; written contiguous, on CPU).
        config: the ``config.json`` content to write (a dict), or None to leave it alone.
        max_shard_bytes: when set and the tensors exceed it, write shards
            ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
            (a tensor larger than the limit gets a shard of its own); else one ``model.safetensors``.
        dtype: convert floating tensors to this dtype (float32 / bfloat16 / float16); FP8
            (``float8_e4m3fn``) tensors, an FP8 checkpoint's weights, are written as they are.

    Returns:
        The file names written.

    Raises:
        UnsupportedDtypeError: ``dtype`` or a tensor's dtype is not float32 / bfloat16 / float16
            / float8_e4m3fn.
    """
    from safetensors.torch import save_file
    if dtype is not None and dtype not in SUPPORTED_LOAD_DTYPES:
        raise UnsupportedDtypeError(f"unsupported save dtype {dtype}; expected float32, bfloat16 or float16")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json", name):
            os.remove(os.path.join(path, name))
    prepared: Dict[str, torch.Tensor] = {}
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu")
        if t.dtype == FP8_WEIGHT_DTYPE:
            prepared[key] = t.contiguous().clone()
            continue
        if t.dtype not in SUPPORTED_LOAD_DTYPES:
            raise UnsupportedDtypeError(f"tensor {key!r} has unsupported dtype {t.dtype}")
        prepared[key] = t.to(dtype or t.dtype).contiguous().clone()
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in prepared.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    written = []
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        tmp = os.path.join(path, name + ".tmp")
        save_file(shard, tmp, metadata={"format": "pt"})
        umask = os.umask(0)  # safetensors creates the file 0600: give it a normal file's mode
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, os.path.join(path, name))
        written.append(name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in prepared.values())},
                 "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}}
        with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        written.append(INDEX_FILE)
    if config is not None:
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(dict(config), f, indent=2, sort_keys=True)
        written.append("config.json")
    return written


def read_checkpoint_tensors(path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` for every tensor of a checkpoint folder, one at a time."""
    with CheckpointReader(path) as reader:
        for key in reader.keys():
            yield key, reader.get(key)

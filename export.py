#!/usr/bin/env python3
"""export.py -- turn a Hugging Face Laguna checkpoint directory into one flat laguna file.

    python3 export.py HF_DIR OUT.bin            # keep the checkpoint's dtype (bf16 stays bf16)
    python3 export.py HF_DIR OUT.bin --dtype f32
    python3 export.py MODEL.bin OUT.bin --dtype q4   # re-export an exported file (e.g. quantize it)

The file (little-endian, read by load_model() in laguna.c; keep the two in step):

    [0, 256)        header: magic "LGNA", version, kind, alignment, file size,
                    offset/size of the config block, offset/count of the tensor directory
    config block    text, one "key=value" per line: every number the C side needs
                    (per-layer lists are space-separated)
    directory       n_tensors entries of 128 bytes: name[80], dtype u32, ndim u32,
                    shape int64[4], offset u64 (absolute, 256-byte aligned)
    tensors         raw data, each aligned to 256 bytes

Matmul weights keep the checkpoint dtype (bf16 or f32; f16 is widened to f32); norms, biases,
the router's correction bias and the RoPE tables are f32. The routed experts are stacked:
mlp.experts.gate_up_proj [E, 2*I, H] (gate rows first, then up) and mlp.experts.down_proj
[E, H, I]. The RoPE inv_freq tables and attention scaling are computed here exactly as
transformers computes them, so config drift is resolved in one place.

Needs numpy only (jinja2 as well when the checkpoint has a chat template).
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np

MAGIC = 0x414E474C          # "LGNA" read as a little-endian uint32
VERSION = 1
ALIGN = 256
HEADER_BYTES = 256
ENTRY_BYTES = 128
NAME_BYTES = 80
DT_F32, DT_BF16, DT_U8, DT_Q8, DT_Q4 = 0, 1, 2, 3, 4
DTYPE_NAMES = {DT_F32: "f32", DT_BF16: "bf16", DT_U8: "u8", DT_Q8: "q8", DT_Q4: "q4"}
DTYPE_SIZE = {DT_F32: 4, DT_BF16: 2, DT_U8: 1}
QGROUP = 32                 # quantization group: consecutive weights of a row sharing one fp16 scale


def tensor_nbytes(dt, shape):
    """Bytes of a tensor in the file. Quantized tensors (q8, q4) are two planes: the values of every row,
    each row padded to whole groups of 32 (int8, or two 4-bit values per byte, low nibble first), then
    one fp16 scale per group of every row."""
    shape = tuple(shape)
    if dt in (DT_Q8, DT_Q4):
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        groups = -(-shape[-1] // QGROUP)
        return rows * groups * (QGROUP if dt == DT_Q8 else QGROUP // 2) + rows * groups * 2
    return int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZE[dt]
KIND_MODEL = 0


class ExportError(Exception):
    """A problem with the input; printed as 'error: ...' plus a hint, exit status 1."""

    def __init__(self, msg, hint=None):
        super().__init__(msg)
        self.hint = hint


# -----------------------------------------------------------------------------
# safetensors, read with numpy (mmap, tensor by tensor)

ST_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2),
             "F64": (np.float64, 8)}


class SafetensorsFile:
    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ExportError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 1 << 30:
                raise ExportError(f"{path}: bad safetensors header length {n}", "is the file truncated?")
            try:
                meta = json.loads(f.read(n))
            except ValueError as e:
                raise ExportError(f"{path}: unreadable safetensors header ({e})")
        self.data_start = 8 + n
        self.meta = {k: v for k, v in meta.items() if k != "__metadata__"}
        self.size = size
        for name, info in self.meta.items():
            if info["dtype"] not in ST_DTYPES:
                raise ExportError(f"{path}: tensor {name} has dtype {info['dtype']}, which laguna does not read",
                                  "laguna reads F32, F16 and BF16 checkpoints (quantized repos are not supported)")
            a, b = info["data_offsets"]
            if self.data_start + b > size:
                raise ExportError(f"{path}: tensor {name} runs past the end of the file", "is the file truncated?")

    def array(self, name, row0=0, row1=None):
        """Rows [row0, row1) of the tensor (along its first axis) as a numpy array, read with pread so
        nothing stays mapped: bf16 comes back as uint16 bit patterns."""
        info = self.meta[name]
        npdt, size = ST_DTYPES[info["dtype"]]
        shape = list(info["shape"]) or [1]
        row1 = shape[0] if row1 is None else row1
        row_bytes = size * int(np.prod(shape[1:], dtype=np.int64))
        a, _ = info["data_offsets"]
        buf = np.empty((row1 - row0) * row_bytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + a + row0 * row_bytes)
            if f.readinto(memoryview(buf)) != buf.size:
                raise ExportError(f"{self.path}: short read in tensor {name}", "is the file truncated?")
        return buf.view(npdt).reshape([row1 - row0] + shape[1:] if info["shape"] else [])


class Checkpoint:
    """All tensors of a checkpoint directory: model.safetensors, or shards listed by the index."""

    def __init__(self, hf_dir):
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(x for x in os.listdir(hf_dir) if x.endswith(".safetensors"))
        if not files:
            raise ExportError(f"no *.safetensors files in {hf_dir}",
                              "pass the directory you downloaded with `hf download poolside/Laguna-XS-2.1 --local-dir DIR`")
        self.where = {}
        for fn in files:
            path = os.path.join(hf_dir, fn)
            if not os.path.exists(path):
                raise ExportError(f"{fn} is listed in model.safetensors.index.json but missing",
                                  "the download is incomplete; run the download again")
            st = SafetensorsFile(path)
            for name in st.meta:
                self.where[name] = st

    def has(self, name):
        return name in self.where

    def shape(self, name):
        return tuple(self.where[name].meta[name]["shape"])

    def dtype(self, name):
        return self.where[name].meta[name]["dtype"]

    def array(self, name, row0=0, row1=None):
        return self.where[name].array(name, row0, row1)

    def chunks(self, name, max_bytes=16 << 20):
        """The tensor in pieces of whole rows, at most ~max_bytes each: export streams, whatever the size."""
        shape = self.shape(name)
        if len(shape) < 2:
            yield self.array(name)
            return
        row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * ST_DTYPES[self.dtype(name)][1])
        step = max(1, max_bytes // row_bytes)
        for r in range(0, shape[0], step):
            yield self.array(name, r, min(shape[0], r + step))


# -----------------------------------------------------------------------------
# numeric helpers

def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round-to-nearest-even, as torch's .to(torch.bfloat16) does (NaN kept NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def convert(arr, src_dtype, dst):
    """Convert a checkpoint array (src_dtype is the safetensors name) to laguna dtype dst."""
    if dst == DT_BF16:
        if src_dtype == "BF16":
            return np.ascontiguousarray(arr)
        return f32_to_bf16(np.asarray(arr, dtype=np.float32))
    if src_dtype == "BF16":
        return bf16_to_f32(np.asarray(arr))
    return np.ascontiguousarray(arr, dtype=np.float32)


# -----------------------------------------------------------------------------
# RoPE tables, computed step by step in fp32 exactly as transformers does (modeling_rope_utils: default / linear /
# yarn / llama3 / dynamic / proportional), so the C side just reads them. Where transformers writes `number / tensor`
# torch computes reciprocal(tensor) * number (Tensor.__rtruediv__), and a Python number meets an fp32 tensor as fp32.

F32 = np.float32


def _pow_f32(base, expo):
    # torch computes base ** x in fp32 (the base rounded to fp32 first); the correctly rounded fp32 of the double
    # result matches it for the real checkpoints' tables (torch's own powf can be 1 ulp off elsewhere)
    return np.array([math.pow(float(F32(base)), float(e)) for e in expo], dtype=np.float64).astype(F32)


def rope_default_inv_freq(base, dim):
    expo = np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)
    return F32(1.0) / _pow_f32(base, expo)


def rope_yarn(base, dim, p, max_pos, truncate):
    factor = p.get("factor")
    orig = p["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / orig
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    expo = np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)
    pos_freqs = _pow_f32(base, expo)
    extrap = F32(1.0) / pos_freqs
    interp = F32(1.0) / (F32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), F32(0), F32(1))
    ef = F32(1) - ramp
    inv_freq = interp * (F32(1) - ef) + extrap * ef
    return inv_freq.astype(F32), float(attention_factor)


def rope_llama3(base, dim, p):
    """Llama 3's rule: wavelengths longer than original / low_freq_factor slowed by factor, shorter than original /
    high_freq_factor kept, a linear blend between (fixed tables: they do not change with the sequence)"""
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if p.get(k) is None:
            raise ExportError(f"llama3 RoPE needs {k}", "transformers refuses such a config too")
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    if hi == lo:
        raise ExportError("llama3 RoPE with high_freq_factor == low_freq_factor (a division by zero in its blend)")
    inv = rope_default_inv_freq(base, dim)
    wavelen = (F32(1) / inv) * F32(2 * math.pi)
    long_wl, short_wl = F32(old / lo), F32(old / hi)
    slowed = np.where(wavelen > long_wl, inv / F32(factor), inv).astype(F32)
    smooth = ((F32(1) / wavelen) * F32(old) - F32(lo)) / F32(hi - lo)
    blended = (((F32(1) - smooth) * slowed) / F32(factor) + smooth * slowed).astype(F32)
    medium = ~(wavelen < short_wl) & ~(wavelen > long_wl)
    return np.where(medium, blended, slowed).astype(F32), 1.0


def rope_dynamic(base, dim, p, max_pos):
    """dynamic NTK: the base grows once the sequence passes max_position_embeddings. laguna's context (-c) never
    does, so its table is transformers' table at init: the base at sequence length max_position_embeddings"""
    factor = p.get("factor")
    if factor is None:
        raise ExportError("dynamic RoPE needs a factor")
    if dim <= 2:
        raise ExportError(f"dynamic RoPE with rotary dim {dim} (its exponent dim / (dim - 2) is undefined)")
    base = base * ((factor * max_pos / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return rope_default_inv_freq(base, dim), 1.0


def rope_proportional(base, head_dim, p):
    """proportional: every dim of the head rotates in pairs (d, d + head_dim / 2), the first partial_rotary_factor
    of the pairs at base ** (-2i / head_dim) / factor, the rest at frequency 0 (cos 1, sin 0: unchanged)"""
    angles = int(p.get("partial_rotary_factor", 1.0) * head_dim // 2)
    expo = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(F32) / F32(head_dim)
    inv = np.zeros(head_dim // 2, dtype=F32)
    inv[:angles] = F32(1.0) / _pow_f32(base, expo)
    return (inv / F32(p.get("factor", 1.0))).astype(F32), 1.0


def rope_tables(rope, head_dim, max_pos, truncate):
    """rope: {'full_attention': {...}, 'sliding_attention': {...}} -> {type: (inv_freq, scaling, rotary_dim)}
    rotary_dim is twice the table's length: transformers rotates that many leading dims of a head in pairs (d, d +
    rotary_dim / 2). For an odd head_dim * partial_rotary_factor its table has (dim + 1) / 2 entries, so one more."""
    out = {}
    for lt, p in rope.items():
        rtype = p.get("rope_type", p.get("type", "default"))
        base = p.get("rope_theta")
        if base is None:
            raise ExportError(f"rope_parameters[{lt!r}] has no rope_theta")
        dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
        if dim <= 0 or dim > head_dim:
            raise ExportError(f"rope_parameters[{lt!r}]: rotary dim {dim} is not in (0, {head_dim}]",
                              "partial_rotary_factor must be in (0, 1]")
        if rtype == "default":
            inv, scale = rope_default_inv_freq(base, dim), 1.0
        elif rtype == "linear":
            inv, scale = (rope_default_inv_freq(base, dim) / F32(p["factor"])).astype(F32), 1.0
        elif rtype == "yarn":
            if "factor" not in p:
                raise ExportError(f"rope_parameters[{lt!r}] is yarn but has no factor")
            if dim % 2:
                raise ExportError(f"rope_parameters[{lt!r}]: yarn with an odd rotary dim {dim}",
                                  "transformers fails on it too (its ramp has dim // 2 entries, the table one more)")
            inv, scale = rope_yarn(base, dim, p, max_pos, truncate)
        elif rtype == "llama3":
            inv, scale = rope_llama3(base, dim, p)
        elif rtype == "dynamic":
            inv, scale = rope_dynamic(base, dim, p, max_pos)
        elif rtype == "proportional":
            inv, scale = rope_proportional(base, head_dim, p)
        else:
            raise ExportError(f"rope_parameters[{lt!r}] has rope_type {rtype!r}, which laguna does not implement",
                              "supported: default, linear, yarn, llama3, dynamic, proportional (longrope switches "
                              "tables with the sequence length)")
        if 2 * len(inv) > head_dim:
            raise ExportError(f"rope_parameters[{lt!r}]: {2 * len(inv)} rotary dims in a head of {head_dim}")
        out[lt] = (inv, scale, 2 * len(inv))
    return out


# -----------------------------------------------------------------------------
# config.json -> the numbers the C side needs

# keys that do not change the math of the forward pass (or that transformers ignores)
IGNORED_KEYS = {
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "router_aux_loss_coef", "output_router_logits", "attention_dropout", "_name_or_path",
    "name_or_path", "tie_word_embeddings", "hidden_act", "pad_token_id", "bos_token_id", "eos_token_id",
    "num_attention_heads",  # only the default for num_attention_heads_per_layer
    # legacy keys present in released configs; transformers' Laguna ignores them
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "gating_types", "rope_theta",
    "partial_rotary_factor", "swa_rope_parameters", "keys_to_ignore_at_inference",
    "return_dict", "output_hidden_states", "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder",
    "tokenizer_class", "problem_type", "id2label", "label2id", "max_length", "generation_config",
    "moe_apply_router_weight_on_input", "dflash_config",
}
USED_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
    "num_attention_heads_per_layer", "layer_types", "mlp_layer_types", "sliding_window",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
    "moe_routed_scaling_factor", "moe_router_logit_softcapping", "rms_norm_eps", "max_position_embeddings",
    "gating", "attention_bias", "rope_parameters", "rope_scaling",   # rope_scaling: transformers' alias of rope_parameters
}


# Keys of the older remote-code LagunaConfig (vLLM's Laguna reads them): each is taken at the value that is
# Laguna's math (transformers' implementation has no switch for it) and refused at any other.
SWITCH_KEYS = {
    "qkv_bias": (False, "biases on q / k / v"),
    "swa_attention_sink_enabled": (False, "attention sinks on the sliding layers"),
    "moe_router_use_sigmoid": (True, "a router that is not a sigmoid"),
    "moe_router_score_func": ("sigmoid", "a router score function other than the sigmoid"),
    "rope_style": ("rotate-half", "RoPE pairs other than rotate-half (dims i and i + d/2)"),
}


def refuse_switches(cfg, ignore_keys, what="config.json", keys=tuple(SWITCH_KEYS)):
    for key in keys:
        want, meaning = SWITCH_KEYS[key]
        if key in cfg and key not in ignore_keys and cfg[key] is not None and cfg[key] != want:
            raise ExportError(f"{what} sets {key} = {json.dumps(cfg[key])}: {meaning}, which laguna (like "
                              f"transformers' Laguna) does not implement; it reads only {json.dumps(want)}",
                              f"if the checkpoint does not use it after all, pass --ignore-key {key}")


def refuse_prequantized(cfg, ignore_keys, what="config.json"):
    """A quantization_config marks a pre-quantized checkpoint (poolside's FP8 / INT4 / NVFP4 releases): its weights
    are packed in formats laguna does not read. Say so plainly rather than as an unknown key."""
    qc = cfg.get("quantization_config")
    if qc is None or "quantization_config" in ignore_keys:
        return
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else qc
    fmt = qc.get("format") if isinstance(qc, dict) else None
    raise ExportError(f"{what} has a quantization_config (quant_method {method!r}"
                      f"{f', format {fmt!r}' if fmt else ''}): this is a pre-quantized checkpoint, whose packed "
                      "weights laguna does not read",
                      "export the bf16 checkpoint instead and quantize it here with --dtype q8 or --dtype q4")


def read_config(hf_dir, ignore_keys=(), warn=print):
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise ExportError(f"no config.json in {hf_dir}", "pass a Hugging Face checkpoint directory")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "laguna":
        raise ExportError(f"config.json has model_type {cfg.get('model_type')!r}, not 'laguna'",
                          "export.py converts poolside Laguna checkpoints only")
    archs = cfg.get("architectures") or ["LagunaForCausalLM"]
    if "LagunaForCausalLM" not in archs:
        raise ExportError(f"unsupported architecture {archs}", "expected LagunaForCausalLM")
    refuse_prequantized(cfg, ignore_keys)
    refuse_switches(cfg, ignore_keys)
    unknown = sorted(k for k in cfg if k not in IGNORED_KEYS and k not in USED_KEYS and k not in SWITCH_KEYS and
                     k not in ignore_keys)
    if unknown:
        raise ExportError(f"config.json has keys laguna does not know: {', '.join(unknown)}",
                          "they may change the math; if you are sure they do not, pass --ignore-key KEY for each")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):     # transformers: swish is silu
        raise ExportError(f"hidden_act {cfg['hidden_act']!r} is not supported (laguna implements silu)")
    if cfg.get("moe_apply_router_weight_on_input", False):
        raise ExportError("moe_apply_router_weight_on_input=true is not supported (transformers refuses it too)")

    L = cfg.get("num_hidden_layers", 40)
    c = {}
    c["vocab_size"] = cfg.get("vocab_size", 100352)
    c["hidden_size"] = cfg.get("hidden_size", 2048)
    c["n_layers"] = L
    c["n_kv_heads"] = cfg.get("num_key_value_heads", 8)
    # transformers' LagunaConfig defaults head_dim to 128 when the key is absent; a null head_dim falls back to
    # hidden / heads, as its rotary embedding does (its attention cannot run one)
    c["head_dim"] = cfg.get("head_dim", 128) or c["hidden_size"] // cfg.get("num_attention_heads", 48)
    heads = cfg.get("num_attention_heads_per_layer") or [cfg.get("num_attention_heads", 48)] * L
    lt = cfg.get("layer_types") or ["full_attention"] * L
    mt = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (L - 1)
    for key, lst in (("num_attention_heads_per_layer", heads), ("layer_types", lt), ("mlp_layer_types", mt)):
        if len(lst) != L:
            raise ExportError(f"{key} has {len(lst)} entries but num_hidden_layers is {L}")
    for x in lt:
        if x not in ("full_attention", "sliding_attention"):
            raise ExportError(f"layer type {x!r} is not supported (full_attention or sliding_attention)")
    for x in mt:
        if x not in ("dense", "sparse"):
            raise ExportError(f"mlp layer type {x!r} is not supported (dense or sparse)")
    for h in heads:
        if h <= 0 or h % c["n_kv_heads"]:
            raise ExportError(f"{h} query heads is not a multiple of {c['n_kv_heads']} kv heads")
    c["n_heads"] = heads
    c["layer_types"] = lt
    c["mlp_layer_types"] = mt
    c["sliding_window"] = cfg.get("sliding_window", 512) if "sliding_attention" in lt else 0
    if "sliding_attention" in lt and not c["sliding_window"]:
        raise ExportError("sliding_attention layers but sliding_window is null/0")
    c["intermediate_size"] = cfg.get("intermediate_size", 8192)
    c["moe_intermediate_size"] = cfg.get("moe_intermediate_size", 512)
    c["shared_expert_intermediate_size"] = cfg.get("shared_expert_intermediate_size", 512)
    c["num_experts"] = cfg.get("num_experts", 256)
    c["num_experts_per_tok"] = cfg.get("num_experts_per_tok", 8)
    sizes = [("hidden_size", c["hidden_size"]), ("vocab_size", c["vocab_size"]), ("head_dim", c["head_dim"]),
             ("num_key_value_heads", c["n_kv_heads"])]
    if "dense" in mt:
        sizes.append(("intermediate_size", c["intermediate_size"]))
    if "sparse" in mt:
        sizes += [(k, c[k]) for k in ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts")]
    for key, v in sizes:
        if not isinstance(v, int) or v <= 0:
            raise ExportError(f"{key} is {v!r}; laguna needs a positive size",
                              "a zero-width layer adds nothing: drop it from the checkpoint and its config")
    if "sparse" in mt and not (0 < c["num_experts_per_tok"] <= c["num_experts"]):
        raise ExportError(f"num_experts_per_tok {c['num_experts_per_tok']} not in 1..num_experts")
    c["routed_scaling_factor"] = float(cfg.get("moe_routed_scaling_factor", 1.0))
    c["router_logit_softcapping"] = float(cfg.get("moe_router_logit_softcapping") or 0.0)
    c["rms_norm_eps"] = float(cfg.get("rms_norm_eps", 1e-6))
    c["max_position_embeddings"] = cfg.get("max_position_embeddings", 131072)
    gating = cfg.get("gating", True)
    if gating is True or gating == "per-head":
        c["gating"] = "per-head"
    elif gating is False or gating == "per-element":
        c["gating"] = "per-element"   # transformers: anything but true / "per-head" gates per element
    else:
        raise ExportError(f"gating {gating!r} is not understood", "expected true, 'per-head' or 'per-element'")
    c["attention_bias"] = bool(cfg.get("attention_bias", False))
    c["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))

    # RoPE, per layer type, with transformers' defaults and drift rules (spec section 1.3)
    rp = cfg.get("rope_parameters")
    if cfg.get("rope_scaling") is not None:
        # transformers' config.rope_scaling is an alias whose setter overwrites rope_parameters (a null one is
        # left alone here: transformers would lose the RoPE and fail)
        if rp is not None and rp != cfg["rope_scaling"]:
            warn("note: config.json has both rope_parameters and rope_scaling; rope_scaling wins, as in transformers")
        rp = cfg["rope_scaling"]
    max_pos = c["max_position_embeddings"]
    defaults = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
    if rp is None:
        rope = defaults
    elif not isinstance(rp, dict):
        raise ExportError("rope_parameters is not a dict")
    elif set(rp) & {"full_attention", "sliding_attention"}:
        flat = sorted(k for k in rp if k not in ("full_attention", "sliding_attention", "truncate"))
        if flat:
            warn(f"note: rope_parameters mixes nested and flat keys (transformers 5.17 cannot load this); the flat ones "
                 f"({', '.join(flat)}) are ignored")
        rope = {}
        for t in set(lt):
            p = rp.get(t)
            if not isinstance(p, dict):
                raise ExportError(f"rope_parameters has no dict for {t!r}")
            rope[t] = dict(p)
    else:
        # older flat format (one dict for full layers, swa_rope_parameters for sliding layers); transformers'
        # LagunaRotaryEmbedding cannot read it, the remote code did: map it onto the nested form
        warn("note: flat rope_parameters (older Laguna format): used for full_attention layers; "
             "sliding_attention from swa_rope_parameters")
        full = dict(rp)
        if "partial_rotary_factor" not in full and "partial_rotary_factor" in cfg:
            full["partial_rotary_factor"] = cfg["partial_rotary_factor"]
        if "rope_theta" not in full:
            full["rope_theta"] = cfg.get("rope_theta", 500000.0)
        swa = dict(cfg.get("swa_rope_parameters") or defaults["sliding_attention"])
        if swa.get("rope_type") == "linear" and "factor" not in swa:
            swa["rope_type"] = "default"
        rope = {"full_attention": full, "sliding_attention": swa}
    for t, p in rope.items():
        p.setdefault("rope_type", p.get("type", "default"))
        if p.get("rope_theta") is None and cfg.get("rope_theta") is not None:
            p["rope_theta"] = cfg["rope_theta"]
        if "partial_rotary_factor" not in p and cfg.get("partial_rotary_factor") is not None:
            p["partial_rotary_factor"] = cfg["partial_rotary_factor"]
        if p["rope_type"] == "yarn" and "original_max_position_embeddings" not in p:
            # transformers 5.17 refuses this config (KeyError in validation); older code silently used
            # max_position_embeddings, a very different ramp. Refuse rather than guess.
            raise ExportError(f"rope_parameters[{t!r}] is yarn but has no original_max_position_embeddings",
                              "add the value the model was trained with (4096 for Laguna-XS.2, 8192 for XS-2.1)")
    truncate = rp.get("truncate", True) if isinstance(rp, dict) else True
    c["rope"] = rope_tables({t: rope[t] for t in sorted(set(lt))}, c["head_dim"], max_pos, truncate)
    c["raw"] = cfg
    return c


def read_special_ids(hf_dir, cfg):
    """BOS / EOS list / PAD / MASK ids: config.json, then generation_config.json (EOS list wins there)."""
    raw = cfg["raw"]
    bos = raw.get("bos_token_id")
    eos = raw.get("eos_token_id")
    pad = raw.get("pad_token_id")
    gpath = os.path.join(hf_dir, "generation_config.json")
    if os.path.exists(gpath):
        with open(gpath) as f:
            g = json.load(f)
        eos = g.get("eos_token_id", eos)
        bos = g.get("bos_token_id", bos) if bos is None else bos
        pad = g.get("pad_token_id", pad) if pad is None else pad
    if eos is None:
        eos = []
    elif isinstance(eos, int):
        eos = [eos]
    mask = (raw.get("dflash_config") or {}).get("mask_token_id", 12 if cfg["vocab_size"] > 12 else -1)
    ids = dict(bos_token_id=-1 if bos is None else bos, pad_token_id=-1 if pad is None else pad,
               mask_token_id=mask, eos_token_ids=list(eos))
    for k, v in ids.items():
        for x in (v if isinstance(v, list) else [v]):
            if not (-1 <= x < cfg["vocab_size"]):
                raise ExportError(f"{k} {x} is outside the vocabulary (vocab_size {cfg['vocab_size']})")
    return ids


# -----------------------------------------------------------------------------
# the tensor plan: (file name, laguna dtype, shape, producer of the data)

def is_norm_like(name):
    """Norm weights, biases and the router's correction bias: kept in f32 (the C side reads them as f32)."""
    return (name.endswith("norm.weight") or name.endswith(".bias") or "e_score_correction_bias" in name
            or (".norms." in name or "_norms." in name) and name.endswith(".weight"))


def same_values(ck, a, b, rows=4096):
    """Whether checkpoint tensors a and b hold the same numbers (what torch.equal decides in transformers' tying)."""
    n = ck.shape(a)[0]
    for r in range(0, n, rows):
        x = convert(ck.array(a, r, min(n, r + rows)), ck.dtype(a), DT_F32)
        y = convert(ck.array(b, r, min(n, r + rows)), ck.dtype(b), DT_F32)
        if not np.array_equal(x, y):
            return False
    return True


def plan_tensors(ck, c, want_dtype, warn=print):
    """List what goes into the file, checking every shape against the config. May clear c["tie_word_embeddings"]
    (a checkpoint that holds a different lm_head), as transformers' loading does."""
    H, D, KV = c["hidden_size"], c["head_dim"], c["n_kv_heads"]
    E, I, S, F = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"], \
        c["intermediate_size"]
    V = c["vocab_size"]
    plan = []
    ck_ignored = set()

    def out_dtype(src_name):
        if is_norm_like(src_name) or want_dtype == "f32":
            return DT_F32
        if want_dtype == "bf16":
            return DT_BF16
        return DT_BF16 if ck.dtype(src_name) == "BF16" else DT_F32   # auto: keep (f16 is widened to f32)

    def need(name, shape):
        if not ck.has(name):
            raise ExportError(f"tensor {name} is missing from the checkpoint",
                              "the checkpoint does not match its config.json (or the download is incomplete)")
        got = ck.shape(name)
        if got != tuple(shape):
            raise ExportError(f"tensor {name} has shape {list(got)}, expected {list(shape)} from config.json")

    def direct(name, shape, out_name=None):
        need(name, shape)
        dt = out_dtype(name)
        plan.append((out_name or name, dt, tuple(shape),
                     lambda: (a if isinstance(a, int) else convert(a, ck.dtype(name), dt) for a in ck.chunks(name))))

    def stacked(out_name, parts_per_expert, shape):
        # parts_per_expert(e) -> list of checkpoint names whose rows are concatenated for expert e
        names = [n for e in range(E) for n in parts_per_expert(e)]
        for n in names:
            if not ck.has(n):
                raise ExportError(f"tensor {n} is missing from the checkpoint",
                                  "the checkpoint does not match its config.json")
        dt = out_dtype(names[0])

        def produce():
            for e in range(E):
                yield np.concatenate([convert(ck.array(n), ck.dtype(n), dt) for n in parts_per_expert(e)], axis=0)
        return names, dt, produce

    # tie_word_embeddings, as transformers loads it: with only lm_head.weight on disk the embedding is tied to it;
    # with both on disk and different values they are not tied (transformers warns and keeps both)
    tie, embed = c["tie_word_embeddings"], "model.embed_tokens.weight"
    if tie and not ck.has(embed) and ck.has("lm_head.weight"):
        embed = "lm_head.weight"
        ck_ignored.add("lm_head.weight")
    elif tie and ck.has(embed) and ck.has("lm_head.weight"):
        need("lm_head.weight", (V, H))
        if same_values(ck, embed, "lm_head.weight"):
            ck_ignored.add("lm_head.weight")
        else:
            warn("note: tie_word_embeddings is true but the checkpoint's lm_head.weight differs from its embedding; "
                 "they are not tied (as transformers loads it)")
            c["tie_word_embeddings"] = tie = False
    direct(embed, (V, H), out_name="model.embed_tokens.weight")
    for l in range(c["n_layers"]):
        p = f"model.layers.{l}."
        nh = c["n_heads"][l]
        direct(p + "input_layernorm.weight", (H,))
        direct(p + "self_attn.q_proj.weight", (nh * D, H))
        direct(p + "self_attn.k_proj.weight", (KV * D, H))
        direct(p + "self_attn.v_proj.weight", (KV * D, H))
        if c["attention_bias"]:
            direct(p + "self_attn.q_proj.bias", (nh * D,))
            direct(p + "self_attn.k_proj.bias", (KV * D,))
            direct(p + "self_attn.v_proj.bias", (KV * D,))
        direct(p + "self_attn.q_norm.weight", (D,))
        direct(p + "self_attn.k_norm.weight", (D,))
        direct(p + "self_attn.g_proj.weight", (nh if c["gating"] == "per-head" else nh * D, H))
        direct(p + "self_attn.o_proj.weight", (H, nh * D))
        if c["attention_bias"]:
            direct(p + "self_attn.o_proj.bias", (H,))
        direct(p + "post_attention_layernorm.weight", (H,))
        if c["mlp_layer_types"][l] == "dense":
            direct(p + "mlp.gate_proj.weight", (F, H))
            direct(p + "mlp.up_proj.weight", (F, H))
            direct(p + "mlp.down_proj.weight", (H, F))
            continue
        direct(p + "mlp.gate.weight", (E, H))
        # the correction bias lives under experts on disk (transformers moves it to the gate on load)
        bias = p + "mlp.experts.e_score_correction_bias"
        if not ck.has(bias) and ck.has(p + "mlp.gate.e_score_correction_bias"):
            bias = p + "mlp.gate.e_score_correction_bias"
        direct(bias, (E,), out_name=p + "mlp.experts.e_score_correction_bias")
        if ck.has(p + "mlp.experts.gate_up_proj"):        # already fused (transformers in-memory layout)
            direct(p + "mlp.experts.gate_up_proj", (E, 2 * I, H))
            direct(p + "mlp.experts.down_proj", (E, H, I))
        else:
            for e in (0, E - 1):
                need(p + f"mlp.experts.{e}.gate_proj.weight", (I, H))
                need(p + f"mlp.experts.{e}.up_proj.weight", (I, H))
                need(p + f"mlp.experts.{e}.down_proj.weight", (H, I))
            for e in range(E):
                for part, shp in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                    need(p + f"mlp.experts.{e}.{part}.weight", shp)
            _, dt, prod = stacked(p + "mlp.experts.gate_up_proj",
                                  lambda e, p=p: [p + f"mlp.experts.{e}.gate_proj.weight",
                                                  p + f"mlp.experts.{e}.up_proj.weight"], None)
            plan.append((p + "mlp.experts.gate_up_proj", dt, (E, 2 * I, H), prod))
            _, dt, prod = stacked(p + "mlp.experts.down_proj",
                                  lambda e, p=p: [p + f"mlp.experts.{e}.down_proj.weight"], None)
            plan.append((p + "mlp.experts.down_proj", dt, (E, H, I), prod))
        sh = p + ("mlp.shared_expert." if ck.has(p + "mlp.shared_expert.gate_proj.weight") else "mlp.shared_experts.")
        for part, shp in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
            direct(sh + part + ".weight", shp, out_name=p + "mlp.shared_expert." + part + ".weight")
    direct("model.norm.weight", (H,))
    if not tie:                              # (tied: lm_head is the embedding, settled above)
        if not ck.has("lm_head.weight"):
            raise ExportError("tensor lm_head.weight is missing from the checkpoint (and tie_word_embeddings is false)")
        direct("lm_head.weight", (V, H))
    for t, (inv, _, rd) in sorted(c["rope"].items()):
        plan.append((f"rope.{t}.inv_freq", DT_F32, (rd // 2,), lambda inv=inv: iter([inv])))
    # every checkpoint tensor must be accounted for
    planned_sources = set()
    for name, *_ in plan:
        planned_sources.add(name)
    consumed = set()
    for n in ck.where:
        base = n
        if ".mlp.experts." in n and n.split(".mlp.experts.")[1].split(".")[0].isdigit():
            consumed.add(n)
            continue
        if base in planned_sources or base.replace("mlp.shared_experts.", "mlp.shared_expert.") in planned_sources \
                or base.replace("mlp.gate.e_score", "mlp.experts.e_score") in planned_sources:
            consumed.add(n)
    # persisted rotary buffers (older saves) are recomputed here from the config, as transformers does
    ck_ignored |= {n for n in ck.where if n.endswith("rotary_emb.inv_freq") or n.endswith("_inv_freq")}
    extra = sorted(set(ck.where) - consumed - ck_ignored)
    if extra:
        more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
        raise ExportError(f"unexpected tensor {', '.join(extra[:3])}{more} in the checkpoint",
                          "the checkpoint does not match its config.json (laguna refuses rather than guess)")
    return plan


# -----------------------------------------------------------------------------
# writing

def fmt_float(x):
    return repr(float(x))


def config_text(c, ids, kind=KIND_MODEL):
    lines = [
        ("model_type", "laguna"),
        ("vocab_size", c["vocab_size"]),
        ("hidden_size", c["hidden_size"]),
        ("n_layers", c["n_layers"]),
        ("n_kv_heads", c["n_kv_heads"]),
        ("head_dim", c["head_dim"]),
        ("n_heads", " ".join(str(h) for h in c["n_heads"])),
        ("layer_types", " ".join("full" if t == "full_attention" else "sliding" for t in c["layer_types"])),
        ("mlp_types", " ".join(c["mlp_layer_types"])),
        ("sliding_window", c["sliding_window"]),
        ("intermediate_size", c["intermediate_size"]),
        ("moe_intermediate_size", c["moe_intermediate_size"]),
        ("shared_expert_intermediate_size", c["shared_expert_intermediate_size"]),
        ("n_experts", c["num_experts"]),
        ("n_experts_per_tok", c["num_experts_per_tok"]),
        ("routed_scaling_factor", fmt_float(c["routed_scaling_factor"])),
        ("router_logit_softcapping", fmt_float(c["router_logit_softcapping"])),
        ("rms_norm_eps", fmt_float(c["rms_norm_eps"])),
        ("max_position_embeddings", c["max_position_embeddings"]),
        ("gating", c["gating"]),
        ("attention_bias", int(c["attention_bias"])),
        ("tie_word_embeddings", int(c["tie_word_embeddings"])),
        ("bos_token_id", ids["bos_token_id"]),
        ("eos_token_ids", " ".join(str(x) for x in ids["eos_token_ids"])),
        ("pad_token_id", ids["pad_token_id"]),
        ("mask_token_id", ids["mask_token_id"]),
    ]
    for t in ("full_attention", "sliding_attention"):
        if t in c["rope"]:
            inv, scale, rd = c["rope"][t]
            short = "full" if t == "full_attention" else "sliding"
            lines.append((f"rope_{short}_rotary_dim", rd))
            lines.append((f"rope_{short}_attention_scaling", fmt_float(scale)))
    return "".join(f"{k}={v}\n" for k, v in lines).encode()


def align(x):
    return (x + ALIGN - 1) // ALIGN * ALIGN


class Progress:
    def __init__(self, total, label, quiet=False):
        self.total, self.done, self.label, self.t0, self.last = max(total, 1), 0, label, time.time(), 0.0
        self.tty, self.quiet = sys.stderr.isatty(), quiet

    def add(self, n):
        self.done += n
        now = time.time()
        if self.quiet:
            return
        if now - self.last > 0.2 or self.done >= self.total:
            self.last = now
            frac = self.done / self.total
            bar = "#" * int(frac * 30)
            rate = self.done / max(now - self.t0, 1e-9) / 1e6
            msg = f"\r{self.label} [{bar:<30}] {frac * 100:5.1f}% {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB " \
                  f"{rate:.0f} MB/s"
            if self.tty or self.done >= self.total:
                sys.stderr.write(msg + ("\n" if self.done >= self.total else ""))
                sys.stderr.flush()


def write_file(out_path, config_bytes, plan, kind=KIND_MODEL, quiet=False):
    """Lay out and stream the file: header, config text, directory, then every tensor."""
    n = len(plan)
    config_off = HEADER_BYTES
    dir_off = align(config_off + len(config_bytes))
    off = align(dir_off + n * ENTRY_BYTES)
    entries = []
    for name, dt, shape, _ in plan:
        if len(name.encode()) >= NAME_BYTES:
            raise ExportError(f"tensor name too long for the format: {name}")
        if len(shape) > 4:
            raise ExportError(f"tensor {name} has more than 4 dims")
        nbytes = tensor_nbytes(dt, shape)
        entries.append((name, dt, shape, off, nbytes))
        off = align(off + nbytes)
    file_size = off
    header = struct.pack("<IIIIQQQQQ", MAGIC, VERSION, kind, ALIGN, file_size, config_off, len(config_bytes),
                         dir_off, n)
    header += b"\0" * (HEADER_BYTES - len(header))
    directory = bytearray()
    for name, dt, shape, o, _ in entries:
        dims = list(shape) + [0] * (4 - len(shape))
        directory += struct.pack("<80sII4qQ", name.encode(), dt, len(shape), *dims, o)
    tmp = out_path + ".partial"
    total = sum(e[4] for e in entries)
    prog = Progress(total, "exporting", quiet)
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(config_bytes)
        f.seek(dir_off)
        f.write(directory)
        for (name, dt, shape, o, nbytes), (_, _, _, produce) in zip(entries, plan):
            f.seek(o)
            written = 0
            for chunk in produce():
                if isinstance(chunk, int):          # a hole (synthetic files): leave zeros, sparse on disk
                    f.seek(chunk, 1)
                    written += chunk
                    prog.add(chunk)
                    continue
                b = memoryview(np.ascontiguousarray(chunk)).cast("B")
                f.write(b)
                written += b.nbytes
                prog.add(b.nbytes)
            if written != nbytes:
                raise ExportError(f"internal: tensor {name} wrote {written} bytes, expected {nbytes}")
        f.truncate(file_size)
    os.replace(tmp, out_path)
    return file_size



# -----------------------------------------------------------------------------
# quantization: group-wise int8 (q8) and 4-bit (q4), symmetric, one fp16 scale per group of 32

def quantize_rows(w, dt):
    """w: float32 [rows, cols] -> (values uint8 bytes [rows, groups*32 or groups*16], scales fp16 [rows, groups],
    dequantized float32 [rows, cols]). q8: q = round(w/d), d = max|w|/127. q4 (like llama.cpp's Q4_0): d = m/-8
    where m is the group's value of largest magnitude, q = clamp(round(w/d) + 8, 0, 15), w ~ (q - 8) * d."""
    rows, cols = w.shape
    groups = -(-cols // QGROUP)
    pad = groups * QGROUP - cols
    x = np.pad(w, ((0, 0), (0, pad))).reshape(rows, groups, QGROUP).astype(np.float32)
    if dt == DT_Q8:
        d = (np.abs(x).max(-1) / 127.0).astype(np.float16)
        df = d.astype(np.float32)[..., None]
        inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
        q = np.clip(np.rint(x * inv), -127, 127).astype(np.int8)
        deq = q.astype(np.float32) * df
        vals = q.reshape(rows, groups * QGROUP).view(np.uint8)
    else:
        idx = np.abs(x).argmax(-1)[..., None]
        m = np.take_along_axis(x, idx, -1)
        d = (m / -8.0).astype(np.float16)
        df = d.astype(np.float32)
        inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
        q = np.clip(np.rint(x * inv) + 8, 0, 15).astype(np.uint8)
        deq = (q.astype(np.float32) - 8) * df
        q = q.reshape(rows, groups * QGROUP)
        vals = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return vals, d.reshape(rows, groups), deq.reshape(rows, groups * QGROUP)[:, :cols]


class QuantStats:
    """Quantization error per tensor and overall, printed like llama2.c's export."""

    def __init__(self, say):
        self.say, self.sq, self.n, self.ref, self.worst = say, 0.0, 0, 0.0, 0.0

    def producer(self, name, dt, chunks, shape):
        cols = shape[-1]

        def run():
            scales, sq, ref, mx, n = [], 0.0, 0.0, 0.0, 0
            for a in chunks():
                w = np.asarray(a, dtype=np.float32).reshape(-1, cols)
                vals, sc, deq = quantize_rows(w, dt)
                err = deq - w
                sq += float(np.square(err, dtype=np.float64).sum())
                ref += float(np.square(w, dtype=np.float64).sum())
                mx = max(mx, float(np.abs(err).max()) if err.size else 0.0)
                n += w.size
                scales.append(sc)
                yield vals
            yield np.concatenate(scales).view(np.uint16)
            rel = math.sqrt(sq / ref) if ref > 0 else 0.0
            self.sq, self.ref, self.n = self.sq + sq, self.ref + ref, self.n + n
            self.worst = max(self.worst, rel)
            pad = f" (last group padded: {cols} is not a multiple of {QGROUP})" if cols % QGROUP else ""
            self.say(f"  {DTYPE_NAMES[dt]} {name}: max abs error {mx:.3g}, relative rms error {rel:.4f}{pad}")
        return run

    def summary(self):
        if self.n:
            self.say(f"quantization: {self.n / 1e6:.1f}M weights, overall relative rms error "
                     f"{math.sqrt(self.sq / self.ref) if self.ref else 0:.4f}, worst tensor {self.worst:.4f}")


def quantized_holes(plan, want_dtype):
    """A synthetic plan's matmul weights as holes of their q8 / q4 size (laguna --random-weights fills them)."""
    return [(n, dt, shp, p) if len(shp) < 2 or n.endswith("mlp.gate.weight") else
            (n, q, shp, lambda q=q, shp=shp: iter([tensor_nbytes(q, shp)]))
            for n, dt, shp, p in plan
            for q in [DT_Q8 if want_dtype == "q8" or n.endswith("embed_tokens.weight") else DT_Q4]]


def quantize_plan(plan, want_dtype, say):
    """Turn the matmul weights of a plan into q8/q4 (embedding rows q8; router, norms, rope, tokenizer kept)."""
    if want_dtype not in ("q8", "q4"):
        return plan, None
    stats = QuantStats(say)
    out = []
    for name, dt, shape, produce in plan:
        if len(shape) < 2 or name.endswith("mlp.gate.weight"):      # norms, biases, rope, tokenizer, router
            out.append((name, dt, shape, produce))
            continue
        qdt = DT_Q8 if (want_dtype == "q8" or name.endswith("embed_tokens.weight")) else DT_Q4

        def chunks(produce=produce, dt=dt):
            for a in produce():
                if isinstance(a, int):
                    raise ExportError("cannot quantize a synthetic file without weights (use --fill random)")
                yield bf16_to_f32(a) if dt == DT_BF16 else a
        out.append((name, qdt, shape, stats.producer(name, qdt, chunks, shape)))
    return out, stats

# -----------------------------------------------------------------------------
# DFlash drafters (poolside/Laguna-XS-2.1-DFlash): same command, recognised from the config

KIND_DRAFTER = 1
DRAFTER_IGNORED = {"architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
                   "use_cache", "initializer_range", "attention_dropout", "_name_or_path", "tie_word_embeddings",
                   "hidden_act", "pad_token_id", "bos_token_id", "eos_token_id", "draft_vocab_size",
                   "target_layer_count", "num_attention_heads_per_layer",
                   "mlp_layer_types", "rope_theta", "partial_rotary_factor", "swa_rope_parameters",
                   "norm_topk_prob", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "shared_expert_intermediate_size", "moe_routed_scaling_factor", "router_aux_loss_coef",
                   "output_router_logits", "mlp_only_layers", "decoder_sparse_step", "gating_types",
                   "moe_router_logit_softcapping", "moe_apply_router_weight_on_input"}
DRAFTER_USED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "layer_types", "sliding_window", "rms_norm_eps",
                "max_position_embeddings", "gating", "attention_bias", "rope_parameters", "dflash_config",
                "rope_scaling", "is_causal", "eagle_aux_hidden_state_layer_ids"}
DFLASH_KEYS = {"block_size", "mask_token_id", "num_target_layers", "target_layer_ids", "causal", "is_causal"}


def is_drafter_config(cfg):
    """A DFlash drafter: its architecture says so; without architectures, a dflash_config says so (a target's
    config may carry one too: its drafter's settings)."""
    archs = cfg.get("architectures") or []
    if any("DFlash" in a for a in archs):
        return True
    return "dflash_config" in cfg and "LagunaForCausalLM" not in archs


def drafter_causal(cfg, dc, lt):
    """Whether the drafter's attention is causal inside the block, resolved as vLLM's DFlash does: a top-level
    is_causal, then dflash_config's is_causal or causal, else sliding layers causal and full layers not."""
    for v in (cfg.get("is_causal"), dc.get("is_causal"), dc.get("causal")):
        if v is not None:
            return bool(v)
    return lt[0] == "sliding_attention"


def read_drafter_config(hf_dir, cfg, ignore_keys=(), warn=print):
    refuse_prequantized(cfg, ignore_keys, "drafter config.json")
    # a drafter has no MoE: the router's keys, copied from its target's config, change nothing
    refuse_switches(cfg, ignore_keys, "drafter config.json", ("qkv_bias", "swa_attention_sink_enabled", "rope_style"))
    unknown = sorted(k for k in cfg if k not in DRAFTER_IGNORED and k not in DRAFTER_USED and k not in SWITCH_KEYS
                     and k not in ignore_keys)
    if unknown:
        raise ExportError(f"drafter config.json has keys laguna does not know: {', '.join(unknown)}",
                          "they may change the math; if you are sure they do not, pass --ignore-key KEY for each")
    dc = cfg.get("dflash_config")
    if not isinstance(dc, dict):
        raise ExportError("drafter config.json has no dflash_config")
    unknown = sorted(k for k in dc if k not in DFLASH_KEYS and "dflash_config." + k not in ignore_keys)
    if unknown:
        raise ExportError(f"drafter dflash_config has keys laguna does not know: {', '.join(unknown)}",
                          "they may change the math; if you are sure they do not, pass --ignore-key dflash_config.KEY")
    # the taps: vLLM prefers eagle_aux_hidden_state_layer_ids, which count the state entering layer k (tap k - 1)
    taps = dc.get("target_layer_ids")
    eagle = cfg.get("eagle_aux_hidden_state_layer_ids")
    if eagle:
        from_eagle = [int(x) - 1 for x in eagle]
        if min(from_eagle) < 0:
            raise ExportError(f"eagle_aux_hidden_state_layer_ids {eagle} taps the embeddings (0), which laguna does not")
        if taps and [int(x) for x in taps] != from_eagle:
            raise ExportError(f"eagle_aux_hidden_state_layer_ids {eagle} and dflash_config.target_layer_ids {taps} "
                              "name different taps (vLLM would use the eagle ids, minus one)",
                              "fix the drafter's config.json: the two must agree (eagle id = target layer id + 1)")
        taps = from_eagle
    if not taps:
        raise ExportError("drafter config.json has no dflash_config.target_layer_ids")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):     # transformers: swish is silu
        raise ExportError(f"drafter hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("attention_bias", False):
        raise ExportError("drafters with attention_bias are not supported")
    L = cfg["num_hidden_layers"]
    lt = cfg.get("layer_types")
    if not lt:
        raise ExportError("drafter config.json has no layer_types (vLLM's Laguna DFlash requires them too)",
                          "add layer_types: the published drafter has sliding_attention on every layer")
    if len(lt) != L:
        raise ExportError(f"drafter layer_types has {len(lt)} entries for {L} layers (num_hidden_layers)")
    if len(set(lt)) != 1:
        raise ExportError(f"drafter layer_types {lt} mixes attention types",
                          "vLLM's Laguna DFlash drafter refuses mixed layer types too (one RoPE and one context K "
                          "for every layer): give every layer the same type")
    if lt[0] not in ("full_attention", "sliding_attention"):
        raise ExportError(f"drafter layer type {lt[0]!r} is not supported (full_attention or sliding_attention)")
    gating = cfg.get("gating", True)
    if gating not in (True, False, "per-head", "per-element", "disabled"):
        raise ExportError(f"drafter gating {gating!r} is not supported (per-head, per-element or disabled)")
    gating = {True: "per-head", False: "none", "disabled": "none"}.get(gating, gating)   # vLLM's reading
    V = cfg.get("draft_vocab_size") or cfg.get("vocab_size")
    if cfg.get("draft_vocab_size") and cfg.get("vocab_size") and cfg["draft_vocab_size"] != cfg["vocab_size"]:
        raise ExportError("draft_vocab_size differs from vocab_size: laguna shares the target's lm_head")
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if nh % nkv:
        raise ExportError(f"drafter: {nh} heads is not a multiple of {nkv} kv heads")
    c = {"vocab_size": V, "hidden_size": cfg["hidden_size"], "n_layers": L, "n_kv_heads": nkv,
         "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // nh, "n_heads": [nh] * L, "layer_types": lt,
         "mlp_layer_types": ["dense"] * L,
         "sliding_window": (cfg.get("sliding_window", 512) or 0) if lt[0] == "sliding_attention" else 0,
         "intermediate_size": cfg["intermediate_size"], "moe_intermediate_size": 0,
         "shared_expert_intermediate_size": 0, "num_experts": 0, "num_experts_per_tok": 0,
         "routed_scaling_factor": 1.0, "router_logit_softcapping": 0.0,
         "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
         "max_position_embeddings": cfg.get("max_position_embeddings", 262144),
         "gating": gating, "attention_bias": False,
         "tie_word_embeddings": False}
    if lt[0] == "sliding_attention" and c["sliding_window"] <= 0:
        raise ExportError("drafter has sliding_attention layers but sliding_window is null or 0")
    # RoPE as vLLM's laguna_dflash resolves it: nested by layer type (falling back to full_attention) or flat;
    # swa_rope_parameters override sliding layers; top-level rope_theta / partial_rotary_factor fill gaps.
    # A non-null rope_scaling is transformers' alias of rope_parameters and replaces it.
    top = (cfg["rope_scaling"] if cfg.get("rope_scaling") is not None else cfg.get("rope_parameters")) or {}
    base = (top.get(lt[0]) or top.get("full_attention") or {}) if any(isinstance(v, dict) for v in top.values()) \
        else top
    swa = cfg.get("swa_rope_parameters")
    p = dict(swa if (lt[0] == "sliding_attention" and swa is not None) else base)
    if swa is not None and lt[0] == "sliding_attention":
        warn("note: drafter has swa_rope_parameters; like vLLM, they set the drafter's RoPE")
    if "partial_rotary_factor" not in p and cfg.get("partial_rotary_factor") is not None:
        p["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    if "rope_theta" not in p:
        p["rope_theta"] = cfg.get("rope_theta", 500000.0)
    p.setdefault("rope_type", p.get("type", "default"))
    c["rope"] = rope_tables({lt[0]: p}, c["head_dim"], c["max_position_embeddings"],
                            top.get("truncate", True) if isinstance(top.get("truncate", True), bool) else True)
    c["dflash"] = {"block_size": int(dc.get("block_size", 16)), "mask_token_id": int(dc.get("mask_token_id", 12)),
                   "target_layer_ids": [int(x) for x in taps], "causal": drafter_causal(cfg, dc, lt),
                   "num_target_layers": int(dc.get("num_target_layers", 0))}
    if not 2 <= c["dflash"]["block_size"] <= 64:
        raise ExportError(f"dflash block_size {c['dflash']['block_size']} is outside 2..64")
    if not 0 <= c["dflash"]["mask_token_id"] < V:
        raise ExportError(f"dflash mask_token_id {c['dflash']['mask_token_id']} is outside the vocabulary")
    if len(c["dflash"]["target_layer_ids"]) > 16:
        raise ExportError("more than 16 target layer taps")
    return c


def plan_drafter(ck, c, want_dtype, say=print):
    H, D, KV, L = c["hidden_size"], c["head_dim"], c["n_kv_heads"], c["n_layers"]
    nh, F = c["n_heads"][0], c["intermediate_size"]
    ntaps = len(c["dflash"]["target_layer_ids"])
    plan, used = [], set()

    def src(name):
        for n in (name, "model." + name):
            if ck.has(n):
                used.add(n)
                return n
        raise ExportError(f"drafter tensor {name} is missing from the checkpoint",
                          "the drafter does not match its config.json")

    def out_dtype(n):
        if is_norm_like(n) or want_dtype == "f32":
            return DT_F32
        if want_dtype == "bf16":
            return DT_BF16
        return DT_BF16 if ck.dtype(n) == "BF16" else DT_F32

    def add(out_name, name, shape, rows=None):
        n = src(name)
        got = ck.shape(n)
        full = (rows[2],) + tuple(shape[1:]) if rows else tuple(shape)
        if got != full:
            raise ExportError(f"drafter tensor {n} has shape {list(got)}, expected {list(full)} from config.json")
        dt = out_dtype(n)
        if rows:          # a row range of a fused tensor
            r0, r1 = rows[0], rows[1]
            plan.append((out_name, dt, tuple(shape), lambda: iter([convert(ck.array(n, r0, r1), ck.dtype(n), dt)])))
        else:
            plan.append((out_name, dt, tuple(shape),          # an int chunk: a hole of a synthetic file
                         lambda: (a if isinstance(a, int) else convert(a, ck.dtype(n), dt) for a in ck.chunks(n))))

    qd, kvd = nh * D, KV * D
    for l in range(L):
        p, o = f"layers.{l}.", f"model.layers.{l}."
        add(o + "input_layernorm.weight", p + "input_layernorm.weight", (H,))
        if ck.has(p + "self_attn.qkv_proj.weight") or ck.has("model." + p + "self_attn.qkv_proj.weight"):
            tot = qd + 2 * kvd
            add(o + "self_attn.q_proj.weight", p + "self_attn.qkv_proj.weight", (qd, H), (0, qd, tot))
            add(o + "self_attn.k_proj.weight", p + "self_attn.qkv_proj.weight", (kvd, H), (qd, qd + kvd, tot))
            add(o + "self_attn.v_proj.weight", p + "self_attn.qkv_proj.weight", (kvd, H), (qd + kvd, tot, tot))
        else:
            add(o + "self_attn.q_proj.weight", p + "self_attn.q_proj.weight", (qd, H))
            add(o + "self_attn.k_proj.weight", p + "self_attn.k_proj.weight", (kvd, H))
            add(o + "self_attn.v_proj.weight", p + "self_attn.v_proj.weight", (kvd, H))
        add(o + "self_attn.q_norm.weight", p + "self_attn.q_norm.weight", (D,))
        add(o + "self_attn.k_norm.weight", p + "self_attn.k_norm.weight", (D,))
        if c["gating"] != "none":
            add(o + "self_attn.g_proj.weight", p + "self_attn.g_proj.weight",
                (nh if c["gating"] == "per-head" else qd, H))
        add(o + "self_attn.o_proj.weight", p + "self_attn.o_proj.weight", (H, qd))
        add(o + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", (H,))
        add(o + "mlp.gate_proj.weight", p + "mlp.gate_proj.weight", (F, H))
        add(o + "mlp.up_proj.weight", p + "mlp.up_proj.weight", (F, H))
        add(o + "mlp.down_proj.weight", p + "mlp.down_proj.weight", (H, F))
    add("model.norm.weight", "norm.weight", (H,))
    add("dflash.fc.weight", "fc.weight", (H, ntaps * H))
    add("dflash.hidden_norm.weight", "hidden_norm.weight", (H,))
    for i in range(ntaps):
        add(f"dflash.aux_hidden_norms.{i}.weight", f"aux_hidden_norms.{i}.weight", (H,))
    for t, (inv, _, rd) in sorted(c["rope"].items()):
        plan.append((f"rope.{t}.inv_freq", DT_F32, (rd // 2,), lambda inv=inv: iter([inv])))
    shared = {n for n in ck.where if n.split("model.")[-1] in ("embed_tokens.weight", "lm_head.weight")}
    if shared:                  # like vLLM: a DFlash drafter always uses the target's embedding and lm_head
        say(f"note: the drafter checkpoint holds {', '.join(sorted(shared))}; the target's are used instead")
    extra = sorted(set(ck.where) - used - shared)
    if extra:
        raise ExportError(f"unexpected tensor {', '.join(extra[:3])} in the drafter checkpoint",
                          "embed_tokens / lm_head come from the target; anything else means a mismatch")
    return plan


def export_drafter(hf_dir, cfg, out_path, dtype, ignore_keys, quiet, ck=None):
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    c = read_drafter_config(hf_dir, cfg, ignore_keys, warn=say)
    ck = ck or Checkpoint(hf_dir)
    plan = plan_drafter(ck, c, dtype if dtype in ("auto", "bf16", "f32") else "auto", say)
    if dtype in ("q8", "q4") and getattr(ck, "fill", None) == "none":     # a synthetic drafter's holes
        plan, stats = quantized_holes(plan, dtype), None
    else:
        plan, stats = quantize_plan(plan, dtype, say)
    d = c["dflash"]
    ids = {"bos_token_id": -1, "pad_token_id": -1, "mask_token_id": d["mask_token_id"], "eos_token_ids": []}
    text = config_text(c, ids) + (
        f"dflash_block_size={d['block_size']}\n"
        f"dflash_target_layer_ids={' '.join(map(str, d['target_layer_ids']))}\n"
        f"dflash_causal={int(d['causal'])}\n"
        f"dflash_num_target_layers={d['num_target_layers']}\n").encode()
    say(f"DFlash drafter: {c['n_layers']} layers, block {d['block_size']}, taps {d['target_layer_ids']}, "
        f"{'causal' if d['causal'] else 'non-causal'}, window {c['sliding_window'] or 'none'}")
    size = write_file(out_path, text, plan, kind=KIND_DRAFTER, quiet=quiet)
    if stats:
        stats.summary()
    say(f"wrote {out_path}: {len(plan)} tensors, {size / 2**30:.3f} GiB")
    return size


# -----------------------------------------------------------------------------
# synthetic checkpoints: the exact Laguna shapes without the 67 GB download (benchmarks, GPU tests)

XS_BASE = dict(model_type="laguna", architectures=["LagunaForCausalLM"], vocab_size=100352, hidden_size=2048,
               intermediate_size=8192, num_hidden_layers=40, num_key_value_heads=8, head_dim=128,
               num_attention_heads_per_layer=[48, 64, 64, 64] * 10,
               layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"] * 10,
               mlp_layer_types=["dense"] + ["sparse"] * 39, sliding_window=512, moe_intermediate_size=512,
               shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
               moe_routed_scaling_factor=2.5, rms_norm_eps=1e-6, gating="per-head", bos_token_id=2,
               eos_token_id=[2, 24], pad_token_id=9)
SYNTHETIC = {
    "XS-2.1": dict(XS_BASE, max_position_embeddings=262144, rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                           "original_max_position_embeddings": 8192, "beta_slow": 1.0, "beta_fast": 64.0,
                           "attention_factor": 1.3465735902799727, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}),
    "XS.2": dict(XS_BASE, max_position_embeddings=131072, rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                           "original_max_position_embeddings": 4096, "beta_slow": 1.0, "beta_fast": 64.0,
                           "attention_factor": 1.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}),
    # poolside/Laguna-XS-2.1-DFlash's config.json (shared/spec/dflash.md): the drafter of XS-2.1
    "XS-2.1-DFlash": dict(model_type="laguna", architectures=["DFlashLagunaForCausalLM"], vocab_size=100352,
                          hidden_size=2048, intermediate_size=8192, num_hidden_layers=5, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128, layer_types=["sliding_attention"] * 5,
                          sliding_window=512, rms_norm_eps=1e-6, gating="per-head", attention_bias=False,
                          max_position_embeddings=262144, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 500000.0},
                          dflash_config={"block_size": 16, "mask_token_id": 12, "num_target_layers": 40,
                                         "target_layer_ids": [1, 13, 25, 33, 39], "causal": True}),
}


class SyntheticCheckpoint:
    """Stands in for a Checkpoint: the tensors a config implies, filled with random bf16 at the scale of a
    trained model (std 1/sqrt(fan_in); norms 1, correction bias 0) or, with fill='none', left as holes in a
    sparse file (zeros: for benchmarks that fill the weights on the GPU, `laguna --random-weights`)."""

    def __init__(self, cfg, fill, seed=0):
        self.fill, self.seed, self.shapes = fill, seed, {}
        if is_drafter_config(cfg):
            self.drafter_shapes(cfg)
            return
        H, D, KV = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]
        E, I, S = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        F, V = cfg["intermediate_size"], cfg["vocab_size"]
        sh = self.shapes
        sh["model.embed_tokens.weight"] = (V, H)
        sh["lm_head.weight"] = (V, H)
        sh["model.norm.weight"] = (H,)
        for l in range(cfg["num_hidden_layers"]):
            p, nh = f"model.layers.{l}.", cfg["num_attention_heads_per_layer"][l]
            sh.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (nh * D, H), p + "self_attn.k_proj.weight": (KV * D, H),
                       p + "self_attn.v_proj.weight": (KV * D, H), p + "self_attn.o_proj.weight": (H, nh * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                       p + "self_attn.g_proj.weight": (nh, H)})
            if cfg["mlp_layer_types"][l] == "dense":
                sh.update({p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                           p + "mlp.down_proj.weight": (H, F)})
            else:
                sh.update({p + "mlp.gate.weight": (E, H), p + "mlp.experts.e_score_correction_bias": (E,),
                           p + "mlp.experts.gate_up_proj": (E, 2 * I, H), p + "mlp.experts.down_proj": (E, H, I),
                           p + "mlp.shared_expert.gate_proj.weight": (S, H),
                           p + "mlp.shared_expert.up_proj.weight": (S, H),
                           p + "mlp.shared_expert.down_proj.weight": (H, S)})
        self.where = dict.fromkeys(sh)

    def drafter_shapes(self, cfg):
        """A DFlash drafter's tensors, as its checkpoint names them (q/k/v split; no embedding or lm_head)."""
        H, D, KV, nh = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"], cfg["num_attention_heads"]
        F, taps = cfg["intermediate_size"], cfg["dflash_config"]["target_layer_ids"]
        sh = self.shapes
        sh.update({"fc.weight": (H, len(taps) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)})
        sh.update({f"aux_hidden_norms.{i}.weight": (H,) for i in range(len(taps))})
        for l in range(cfg["num_hidden_layers"]):
            p = f"layers.{l}."
            sh.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (nh * D, H), p + "self_attn.k_proj.weight": (KV * D, H),
                       p + "self_attn.v_proj.weight": (KV * D, H), p + "self_attn.o_proj.weight": (H, nh * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                       p + "self_attn.g_proj.weight": (nh, H), p + "mlp.gate_proj.weight": (F, H),
                       p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F)})
        self.where = dict.fromkeys(sh)

    def has(self, name):
        return name in self.shapes

    def shape(self, name):
        return self.shapes[name]

    def dtype(self, name):
        return "F32" if is_norm_like(name) else "BF16"

    def chunks(self, name, max_bytes=64 << 20):
        shape = self.shapes[name]
        if is_norm_like(name):
            yield np.full(shape, 0.0 if "bias" in name else 1.0, dtype=np.float32)
            return
        n = int(np.prod(shape, dtype=np.int64))
        if self.fill == "none":
            yield n * 2                                   # a hole of this many bytes
            return
        rng = np.random.default_rng([self.seed, zlib_crc(name)])
        std = 1.0 / math.sqrt(shape[-1])
        rows = shape[0] if len(shape) == 2 else shape[0] * shape[1]
        row = shape[-1]
        step = max(1, (max_bytes // 4) // row)
        for r in range(0, rows, step):
            k = min(step, rows - r)
            yield f32_to_bf16(rng.standard_normal((k, row), dtype=np.float32) * np.float32(std))


def zlib_crc(s):
    import zlib
    return zlib.crc32(s.encode())


def export_synthetic(preset, out_path, fill, layers=None, seed=0, quiet=False, dtype="auto"):
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    if preset not in SYNTHETIC:
        raise ExportError(f"unknown synthetic preset {preset!r}", f"choose one of {', '.join(SYNTHETIC)}")
    raw = json.loads(json.dumps(SYNTHETIC[preset]))
    if layers:
        for k in ("num_attention_heads_per_layer", "layer_types", "mlp_layer_types"):
            if k in raw:
                raw[k] = raw[k][:layers]
        raw["num_hidden_layers"] = layers
    if is_drafter_config(raw):      # a drafter: the same path as a drafter checkpoint
        say(f"synthetic {preset}: {raw['num_hidden_layers']} layers, weights "
            f"{'random' if fill == 'random' else 'left as holes'}")
        return export_drafter(None, raw, out_path, dtype, (), quiet, ck=SyntheticCheckpoint(raw, fill, seed))
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(raw, f)
        c = read_config(d, warn=say)
        ids = read_special_ids(d, c)
    ck = SyntheticCheckpoint(raw, fill, seed)
    plan = plan_tensors(ck, c, "auto", warn=say)
    stats = None
    if dtype in ("q8", "q4") and fill == "none":     # holes of the quantized size: laguna --random-weights fills them
        plan = quantized_holes(plan, dtype)
    else:
        plan, stats = quantize_plan(plan, dtype, say)
    say(f"synthetic {preset}: {c['n_layers']} layers, weights {'random' if fill == 'random' else 'left as holes'}")
    size = write_file(out_path, config_text(c, ids), plan, quiet=quiet)
    say(f"wrote {out_path}: {len(plan)} tensors, {size / 2**30:.2f} GiB")
    return size


# -----------------------------------------------------------------------------
# main

def export_model(hf_dir, out_path, dtype="auto", ignore_keys=(), quiet=False, tokenizer=True, chat=True):
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    cpath = os.path.join(hf_dir, "config.json")
    if os.path.exists(cpath):
        with open(cpath) as f:
            raw = json.load(f)
        if is_drafter_config(raw):
            return export_drafter(hf_dir, raw, out_path, dtype, ignore_keys, quiet)
    c = read_config(hf_dir, ignore_keys, warn=say)
    ids = read_special_ids(hf_dir, c)
    ck = Checkpoint(hf_dir)
    plan = plan_tensors(ck, c, dtype if dtype in ("auto", "bf16", "f32") else "auto", warn=say)
    tok = tokenizer_blob(hf_dir, chat=chat, say=say) if tokenizer else None
    if tok is not None and not chat:
        say("note: --no-chat-template: prompts go in as they are (laguna --raw)")
    if tok is None:
        say(f"note: {'no tokenizer.json' if tokenizer else '--no-tokenizer'}: the file will take token ids only "
            "(--ids, --score)")
    else:
        n_tok = tokenizer_vocab_size_hint(tok) if len(tok) else 0
        if n_tok > c["vocab_size"]:
            raise ExportError(f"tokenizer.json has {n_tok} ids but config.json's vocab_size is "
                              f"{c['vocab_size']}: the embedding has no row for the ids past it",
                              "is tokenizer.json from another checkpoint? use the one saved with these weights")
        arr = np.frombuffer(tok, dtype=np.uint8)
        plan.append(("tokenizer", DT_U8, (len(tok),), lambda arr=arr: iter([arr])))
    layers = c["n_layers"]
    n_full = sum(t == "full_attention" for t in c["layer_types"])
    say(f"laguna: {layers} layers ({n_full} full, {layers - n_full} sliding), hidden {c['hidden_size']}, "
        f"vocab {c['vocab_size']}, experts {c['num_experts']} top-{c['num_experts_per_tok']}")
    for t, (inv, scale, rd) in sorted(c["rope"].items()):
        say(f"rope {t}: rotary dim {rd}, attention scaling {scale!r}")
    plan, stats = quantize_plan(plan, dtype, say)
    size = write_file(out_path, config_text(c, ids), plan, quiet=quiet)
    if stats:
        stats.summary()
    say(f"wrote {out_path}: {len(plan)} tensors, {size / 2**30:.3f} GiB")
    return size


def export_from_laguna_file(src, out_path, dtype, quiet=False):
    """Re-export a laguna file in another weight dtype (e.g. quantize models/tiny.bin to q8 / q4)."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    with open(src, "rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < 56 or struct.unpack_from("<I", head)[0] != MAGIC:
            raise ExportError(f"{src} is not a laguna file (nor a checkpoint directory)")
        magic, ver, kind, al, size, coff, csz, doff, n = struct.unpack_from("<IIIIQQQQQ", head)
        if ver != VERSION or os.path.getsize(src) != size:
            raise ExportError(f"{src}: version {ver} or size mismatch", "re-export it from its checkpoint")
        f.seek(coff)
        cfg = f.read(csz)
        f.seek(doff)
        d = f.read(n * ENTRY_BYTES)
    plan = []
    for i in range(n):
        name, dt, nd, *dims = struct.unpack_from("<80sII4qQ", d, i * ENTRY_BYTES)
        off, shape = dims[4], tuple(dims[:nd])
        name = name.split(b"\0")[0].decode()
        if dt in (DT_Q8, DT_Q4):
            raise ExportError(f"{src} is already quantized ({name}); export from the checkpoint instead")
        npdt = {DT_F32: np.float32, DT_BF16: np.uint16, DT_U8: np.uint8}[dt]
        out_dt = dt
        if dtype in ("f32", "bf16") and len(shape) >= 2:
            out_dt = DT_F32 if dtype == "f32" else DT_BF16

        def produce(off=off, shape=shape, npdt=npdt, dt=dt, out_dt=out_dt):
            rows = shape[0]
            row_elems = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            step = max(1, (16 << 20) // (row_elems * np.dtype(npdt).itemsize))
            with open(src, "rb") as fh:
                for r in range(0, rows, step):
                    k = min(step, rows - r)
                    fh.seek(off + r * row_elems * np.dtype(npdt).itemsize)
                    a = np.frombuffer(fh.read(k * row_elems * np.dtype(npdt).itemsize), dtype=npdt)
                    a = a.reshape((k,) + tuple(shape[1:]))
                    if out_dt != dt:
                        a = f32_to_bf16(a) if out_dt == DT_BF16 else bf16_to_f32(a)
                    yield a
        plan.append((name, out_dt, shape, produce))
    plan, stats = quantize_plan(plan, dtype, say)
    size = write_file(out_path, cfg, plan, kind=kind, quiet=quiet)
    if stats:
        stats.summary()
    say(f"wrote {out_path}: {len(plan)} tensors, {size / 2**30:.3f} GiB")
    return size


def tokenizer_vocab_size_hint(blob):
    """Highest token id + 1 in the tokenizer blob, if the tokenizer code exposes it."""
    fn = globals().get("_tok_blob_vocab_size")
    return fn(blob) if fn else 0


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Convert a Hugging Face Laguna checkpoint directory into one laguna model file.",
        epilog="example: python3 export.py ~/Laguna-XS-2.1 laguna-xs-2.1.bin")
    ap.add_argument("hf_dir", nargs="?", help="checkpoint directory: config.json, *.safetensors, tokenizer.json, ...")
    ap.add_argument("out", nargs="?", help="output file")
    ap.add_argument("--dtype", choices=["auto", "bf16", "f32", "q8", "q4"], default="auto",
                    help="matmul weight dtype (default: auto = keep the checkpoint's; norms are always f32). "
                         "q8: int8, q4: 4-bit, one fp16 scale per 32 weights (embedding q8, router bf16)")
    ap.add_argument("--ignore-key", action="append", default=[], metavar="KEY",
                    help="accept an unknown config.json key you know does not change the math")
    ap.add_argument("--no-chat-template", action="store_true",
                    help="leave the checkpoint's chat template out (if laguna can't reproduce it): prompts then go "
                         "in as they are, with laguna --raw")
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="leave the tokenizer out (if laguna can't reproduce it): the file then takes token ids, "
                         "with laguna --ids")
    ap.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    ap.add_argument("--synthetic", metavar="PRESET", help="write a synthetic model with the exact shapes of "
                    "PRESET (XS-2.1, XS.2, or the drafter XS-2.1-DFlash) instead of converting a checkpoint: OUT is "
                    "then the only argument")
    ap.add_argument("--fill", choices=["random", "none"], default="none",
                    help="synthetic weights: random bf16, or none (a sparse file; laguna --random-weights "
                         "fills them on the GPU). Default none")
    ap.add_argument("--layers", type=int, help="synthetic: keep only the first N layers")
    ap.add_argument("--seed", type=int, default=0, help="synthetic: random seed")
    if argv is None:
        argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if args.synthetic and args.out is None:
        args.hf_dir, args.out = None, args.hf_dir
    if args.out is None:
        ap.error("give HF_DIR and OUT (or --synthetic PRESET OUT)")
    try:
        if args.synthetic:
            export_synthetic(args.synthetic, args.out, args.fill, args.layers, args.seed, args.quiet, args.dtype)
            return 0
        if os.path.isfile(args.hf_dir):          # a laguna file: re-export it in another dtype
            export_from_laguna_file(args.hf_dir, args.out, args.dtype, args.quiet)
            return 0
        if not os.path.isdir(args.hf_dir):
            raise ExportError(f"{args.hf_dir} is not a directory", "pass the checkpoint directory")
        export_model(args.hf_dir, args.out, args.dtype, set(args.ignore_key), args.quiet,
                     tokenizer=not args.no_tokenizer, chat=not args.no_chat_template)
    except ExportError as e:
        print(f"export.py: error: {e}", file=sys.stderr)
        if e.hint:
            print(f"  hint: {e.hint}", file=sys.stderr)
        if os.path.exists(args.out + ".partial"):
            os.remove(args.out + ".partial")
        return 1
    return 0


# ==== tokenizer: begin (owned by the tokenizer work; returns the "tokenizer" blob) ====
# The "tokenizer" tensor (uint8) holds everything tokenizer.c needs. Blob format, version 2, little-endian,
# strings are UTF-8 bytes without a terminating NUL (tokenizer.c parses the same layout in tokenizer_init):
#   char magic[4] = "LGTK";  u32 version = 2
#   u32 n_vocab            ids are 0..n_vocab-1
#   u32 n_merges           merges in rank order (rank = index, lowest merges first)
#   u32 n_added            added tokens (matched literally in the input before pre-tokenization)
#   u32 n_chat             chat-format key/value entries (0: the checkpoint has no chat template)
#   u32 n_whole            BPE ignore_merges: vocabulary ids a whole piece becomes directly (0: merges only)
#   i32 bos_id, eos_id     from tokenizer_config.json (-1 if absent)
#   i32 byte_id[256]       id of the single-byte token for each byte value (GPT-2 byte->unicode map applied)
#   n_vocab x { u32 len; u8 bytes[len] }   what decoding the id emits (HF ByteLevel decoder semantics);
#                                          len = 0xFFFFFFFF: no token has this id (decoding skips it)
#   n_merges x { u32 left, right, merged }
#   n_added x { u32 id; u32 flags (1 special, 2 normalized, 4 lstrip, 8 rstrip, 16 single_word); u32 len;
#               u8 content[len] }
#   n_chat x { u32 klen; u8 key[klen]; u32 vlen; u8 value[vlen] }      see _tok_chat_data for the keys
#   n_whole x u32 id       the ids of the vocabulary's byte-level tokens (a piece is looked up by its bytes)
# Version 1 is version 2 without n_whole (tokenizer.c reads both; models/tiny.bin was written with version 1).
_TOK_MAGIC, _TOK_VERSION = b"LGTK", 2
_TOK_NEWLINE_RE = "(?:\\r?\\n)+(?!\\r?\\n)"
_TOK_QWEN2_RE = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_TOK_HINT = ("HINT: laguna's tokenizer.c implements exactly Laguna's pipeline (no normalizer; Split newline-runs "
             "MergedWithNext > Split Qwen2 regex Isolated > ByteLevel; byte-level BPE by merge rank; ByteLevel "
             "decoder). A different tokenizer needs new C code, not just a new export; or export with "
             "--no-tokenizer, and the file takes token ids (laguna --ids).")


def _tok_blob_vocab_size(blob):
    """n_vocab (highest id + 1) from a tokenizer blob's header."""
    if blob[:4] != _TOK_MAGIC:
        raise ValueError("not a laguna tokenizer blob")
    return int.from_bytes(blob[8:12], "little")


def _tok_refuse(path, what):
    raise SystemExit(f"export: {path}: unsupported tokenizer: {what}\n{_TOK_HINT}")


def _tok_bytes_to_unicode():
    """GPT-2's reversible byte -> printable unicode char map."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _tok_check_pipeline(path, j):
    """Refuse anything that is not exactly Laguna's pipeline: a silently wrong tokenizer is worse than none."""
    if j.get("normalizer") is not None:
        _tok_refuse(path, f"a normalizer ({j['normalizer'].get('type')}); Laguna has none")
    pre = j.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    want = "Sequence[Split(newline runs, MergedWithNext), Split(Qwen2 regex, Isolated), ByteLevel]"
    if not steps or len(steps) != 3:
        _tok_refuse(path, f"pre_tokenizer {pre.get('type')} with {len(steps or [])} steps; want {want}")
    for step, (regex, behavior) in zip(steps[:2], ((_TOK_NEWLINE_RE, "MergedWithNext"), (_TOK_QWEN2_RE, "Isolated"))):
        got = (step.get("type"), (step.get("pattern") or {}).get("Regex"), step.get("behavior"), step.get("invert"))
        if got != ("Split", regex, behavior, False):
            _tok_refuse(path, f"pre-tokenizer step {got}; want Split({regex!r}, {behavior}); full chain: {want}")
    bl = steps[2]
    if bl.get("type") != "ByteLevel" or bl.get("add_prefix_space") or bl.get("use_regex", True):
        _tok_refuse(path, f"pre-tokenizer step 3 is {bl}; want ByteLevel(add_prefix_space=false, use_regex=false)")
    dec = j.get("decoder") or {}
    if dec.get("type") != "ByteLevel":
        _tok_refuse(path, f"decoder {dec.get('type')}; want ByteLevel")
    m = j.get("model") or {}
    if m.get("type") != "BPE":
        _tok_refuse(path, f"model type {m.get('type')}; want BPE")
    # byte_fallback (true or false) changes nothing here: it names <0xXX> tokens for characters missing from the
    # vocabulary, and after ByteLevel every character is one of the 256 byte tokens, all in it (checked below).
    if m.get("dropout") not in (None, 0, 0.0):
        _tok_refuse(path, f"BPE dropout {m.get('dropout')}")
    if m.get("continuing_subword_prefix") or m.get("end_of_word_suffix"):
        _tok_refuse(path, "BPE continuing_subword_prefix / end_of_word_suffix are set")
    # HF tokenizers does not take an added token's id from its "id": a token in the BPE vocabulary gets that id,
    # another one the next free id past the vocabulary. tokenizer.c takes "id"; refuse a file where they differ.
    vocab = m.get("vocab") or {}
    by_id = {i: t for t, i in vocab.items()}
    top = None                                            # the largest id given to an added token so far
    for a in j.get("added_tokens") or []:
        if not a.get("content"):
            _tok_refuse(path, f"added token id {a.get('id')} has empty content")
        hf_id = vocab.get(a["content"])
        if hf_id is None:
            hf_id = top + 1 if top is not None and top >= len(vocab) else len(vocab)
        if hf_id != a.get("id"):
            other = f" (the vocabulary's {by_id[a.get('id')]!r})" if a.get("id") in by_id else ""
            _tok_refuse(path, f"added token {a['content']!r} has id {a.get('id')}{other}, but HF tokenizers would give "
                              f"it id {hf_id}: the file's added_tokens and model.vocab disagree")
        top = hf_id if top is None else max(top, hf_id)


_TOK_FLAGS = ("special", "normalized", "lstrip", "rstrip", "single_word")


def _tok_added_tokens(j, cpath, config, say):
    """The added tokens as transformers loads them: tokenizer.json's, then tokenizer_config.json's
    added_tokens_decoder by ascending key. An entry whose content is already an added token puts its flags over
    that token's; another one is added with the id HF gives it (its vocabulary id, else the next free one past the
    vocabulary), whatever its key says. A list of dicts (id, content, flags) by id."""
    vocab = j["model"].get("vocab") or {}
    by_content = {a["content"]: dict(a) for a in j.get("added_tokens") or []}
    dec = config.get("added_tokens_decoder") or {}
    for k in dec:
        if not str(k).isdigit():
            _tok_refuse(cpath, f"added_tokens_decoder key {k!r} is not a token id")
    for k in sorted(dec, key=int):
        e = dec[k]
        if not isinstance(e, dict) or not e.get("content"):
            continue
        if e["content"] in by_content:
            by_content[e["content"]].update({f: e[f] for f in _TOK_FLAGS if f in e})
            continue
        i = vocab.get(e["content"])
        if i is None:
            top = max((a["id"] for a in by_content.values()), default=None)
            i = top + 1 if top is not None and top >= len(vocab) else len(vocab)
        if i != int(k):
            say(f"tokenizer: note: added_tokens_decoder's {e['content']!r} (key {k}) gets id {i}, as transformers "
                "gives it")
        by_content[e["content"]] = dict(e, id=i)
    return sorted(by_content.values(), key=lambda a: a["id"])


def _tok_u32(x):
    return int(x).to_bytes(4, "little", signed=False)


def _tok_i32(x):
    return int(x).to_bytes(4, "little", signed=True)


def _tok_str(b):
    return _tok_u32(len(b)) + b


def tokenizer_blob(hf_dir, chat=True, say=None):
    """Return the bytes of the 'tokenizer' tensor for the checkpoint in hf_dir, or None if no tokenizer.json.
    Raises SystemExit with a message and a HINT if the tokenizer or its chat template can't be reproduced in C.
    chat=False leaves the chat template out; say(msg) prints progress (default: to stderr)."""
    import json
    import os
    import sys
    say = say or (lambda *a: print(*a, file=sys.stderr))
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    _tok_check_pipeline(path, j)
    for key in ("truncation", "padding"):
        if j.get(key) is not None:
            say(f"tokenizer: note: tokenizer.json sets {key}; transformers encodes without it unless a call asks "
                "for it, and so does laguna")
    config = {}
    cpath = os.path.join(hf_dir, "tokenizer_config.json")
    if os.path.exists(cpath):
        with open(cpath, encoding="utf-8") as f:
            config = json.load(f)
    model = j["model"]
    vocab = model.get("vocab") or {}
    added = _tok_added_tokens(j, cpath, config, say)
    id_to_tok = {}
    for tok, i in vocab.items():
        if not 0 <= i < 2**31 or i in id_to_tok:
            _tok_refuse(path, f"vocab id {i} of {tok!r} is out of range or used twice")
        id_to_tok[i] = tok
    for a in added:
        id_to_tok[a["id"]] = a["content"]          # HF decodes an added id to its content
    n_vocab = max(id_to_tok) + 1 if id_to_tok else 0

    # decoding: HF's ByteLevel decoder maps every char of a token back to its byte, or, if some char is outside
    # the map (e.g. 〈 in 〈|EOS|〉), emits the token's own UTF-8 bytes unchanged
    b2u = _tok_bytes_to_unicode()
    u2b = {u: b for b, u in b2u.items()}
    out = [_TOK_MAGIC, _tok_u32(_TOK_VERSION)]
    body = []
    for i in range(n_vocab):
        tok = id_to_tok.get(i)
        if tok is None:
            body.append(_tok_u32(0xFFFFFFFF))
        elif all(ch in u2b for ch in tok):
            body.append(_tok_str(bytes(u2b[ch] for ch in tok)))
        else:
            body.append(_tok_str(tok.encode("utf-8")))

    byte_id = []
    for b in range(256):
        if b2u[b] not in vocab:
            _tok_refuse(path, f"the byte token {b2u[b]!r} (byte {b}) is not in the vocab; Laguna has all 256")
        byte_id.append(vocab[b2u[b]])

    # merges: both the old "a b" and the new ["a", "b"] spellings. Like HF, a repeated pair keeps its last rank.
    ranked = {}
    for rank, m in enumerate(model.get("merges") or []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a not in vocab or b not in vocab or a + b not in vocab:
            _tok_refuse(path, f"merge #{rank} {a!r} + {b!r}: a part or the result is not in the vocab")
        ranked[(vocab[a], vocab[b])] = (rank, vocab[a + b])
    merges = sorted(ranked.items(), key=lambda kv: kv[1][0])
    for (a, b), (_, c) in merges:
        body.append(_tok_u32(a) + _tok_u32(b) + _tok_u32(c))
    for a in added:
        flags = sum(bit for bit, f in ((1, "special"), (2, "normalized"), (4, "lstrip"), (8, "rstrip"),
                                       (16, "single_word")) if a.get(f))
        body.append(_tok_u32(a["id"]) + _tok_u32(flags) + _tok_str(a["content"].encode("utf-8")))

    by_content = {a["content"]: a["id"] for a in added}
    by_content.update({k: v for k, v in vocab.items() if k not in by_content})

    def special_id(key):
        tok = config.get(key)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        return by_content.get(tok, -1) if tok else -1

    chat_kv = _tok_chat_data(hf_dir, config, say) if chat else {}
    for k, v in chat_kv.items():
        body.append(_tok_str(k.encode("utf-8")) + _tok_str(v.encode("utf-8")))
    # ignore_merges (HF tokenizers' BPE): a piece that is itself in the vocabulary becomes that one token, merges
    # or not. Pieces are byte-level strings, so only vocabulary tokens made of byte-map characters can match.
    whole = sorted(i for tok, i in vocab.items() if all(ch in u2b for ch in tok)) if model.get("ignore_merges") else []
    for i in whole:
        body.append(_tok_u32(i))
    out += [_tok_u32(n_vocab), _tok_u32(len(merges)), _tok_u32(len(added)), _tok_u32(len(chat_kv)),
            _tok_u32(len(whole)), _tok_i32(special_id("bos_token")), _tok_i32(special_id("eos_token"))]
    out += [_tok_i32(x) for x in byte_id]
    blob = b"".join(out + body)
    say(f"tokenizer: {n_vocab} ids, {len(merges)} merges, {len(added)} added tokens, "
          f"{'ignore_merges, ' if whole else ''}chat template: {'yes' if chat_kv else 'no'}, {len(blob)} bytes")
    return blob


# ---- chat format -------------------------------------------------------------------------------------------
# The checkpoint's chat_template.jinja is rendered here with jinja2 (set up like transformers'
# apply_chat_template) for probe conversations whose contents are unique sentinels. The text between two
# sentinels is the fixed "piece" the template emits between those two fields, so tokenizer.c can rebuild any
# prompt by concatenating pieces and contents. Keys (all values are strings):
#   "{t}:{prev}>{next}"   piece between two fields, t = enable_thinking (0/1)
#        prev: start (no system message: the default system prompt is part of the piece), start_empty (after
#              an empty first system message), sys0 (after the first system message's text), sys (after a
#              later system message), user, asst (after an assistant reply's content), asst_e (after an
#              assistant reply whose content is empty: some templates drop a newline then; absent if the
#              template's piece before the content changes too)
#        next: sys0 (only after start), sys, user, asst_r (an assistant turn with reasoning, up to the
#              reasoning), asst_nr (one without, up to its content), end, gen (add_generation_prompt)
#   "{t}:mid"             piece between an assistant turn's reasoning and its content
#   "{t}:reasoning"       "1" if the template shows reasoning when enable_thinking = t, else "0"
#   "strip:{field}"       0 none, 1 lstrip, 2 rstrip, 3 strip (Python str.strip semantics) applied to the
#                         content of field sys0, sys, user, reason, content before it is inserted
# Export verifies that pieces + contents reproduce jinja2 on several conversations and refuses otherwise.
_TOK_CHAT_PREVS = ("start", "start_empty", "sys0", "sys", "user", "asst", "asst_e")
_TOK_CHAT_NEXTS = ("sys0", "sys", "user", "asst_r", "asst_nr", "end", "gen")
_TOK_CHAT_FIELDS = ("sys0", "sys", "user", "reason", "content")


def _tok_jinja_env():
    """A jinja2 environment like transformers' apply_chat_template (trim/lstrip blocks, {% generation %},
    loop controls, tojson without HTML escaping, raise_exception, strftime_now)."""
    import json
    from datetime import datetime
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}   # {% generation %}...{% endgeneration %} marks assistant text; renders its body

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tok_find_template(hf_dir, config):
    import os
    p = os.path.join(hf_dir, "chat_template.jinja")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            return f.read()
    t = config.get("chat_template")
    if isinstance(t, list):   # [{"name": "default", "template": ...}, ...]
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def _tok_render_fn(hf_dir, config):
    """render(messages, add_generation_prompt, enable_thinking) -> str with the checkpoint's template, or None."""
    source = _tok_find_template(hf_dir, config)
    if source is None:
        return None
    template = _tok_jinja_env().from_string(source)
    specials = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = config.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if v is not None:
            specials[k] = v

    def render(messages, add_generation_prompt, enable_thinking):
        return template.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                               **specials)
    return render


def _tok_msg(role, content, reasoning=None):
    m = {"role": role, "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


def _tok_py_strip(s, mode):
    return s.strip() if mode == 3 else s.lstrip() if mode == 1 else s.rstrip() if mode == 2 else s


def _tok_chat_assemble(kv, msgs, add_generation_prompt, enable_thinking):
    """Rebuild a prompt from the pieces, exactly as tokenizer_render_chat does in C. None if unsupported."""
    t = "1" if enable_thinking else "0"
    strip = {f: int(kv.get("strip:" + f, "0")) for f in _TOK_CHAT_FIELDS}
    show_reasoning = kv.get(t + ":reasoning") == "1"
    out, prev = [], "start"
    for i, m in enumerate(msgs):
        role, content = m["role"], m.get("content") or ""
        if role == "system" and i == 0:
            text = _tok_py_strip(content, strip["sys0"])
            if not text:
                prev = "start_empty"
                continue
            parts = [("sys0", text)]
        elif role == "system":
            parts = [("sys", _tok_py_strip(content, strip["sys"]))]
        elif role == "user":
            parts = [("user", _tok_py_strip(content, strip["user"]))]
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or ""
            text = _tok_py_strip(content, strip["content"])
            if reasoning and show_reasoning:
                parts = [("asst_r", _tok_py_strip(reasoning, strip["reason"])), ("mid", text)]
            else:
                parts = [("asst_nr", text)]
            empty = not text and any(k.startswith(t + ":asst_e>") for k in kv)
        else:
            return None
        for nxt, text in parts:
            key = f"{t}:mid" if nxt == "mid" else f"{t}:{prev}>{nxt}"
            if key not in kv:
                return None
            out += [kv[key], text]
            prev = {"sys0": "sys0", "sys": "sys", "user": "user"}.get(nxt, "asst_e" if role == "assistant" and empty
                                                                       else "asst")
    key = f"{t}:{prev}>{'gen' if add_generation_prompt else 'end'}"
    if key not in kv:
        return None
    out.append(kv[key])
    return "".join(out)


def _tok_chat_data(hf_dir, config, say):
    """Probe the checkpoint's chat template and return the chat key/value table ({} if there is no template)."""
    import os
    render = _tok_render_fn(hf_dir, config)
    if render is None:
        say(f"tokenizer: no chat template in {hf_dir} (chat_template.jinja or tokenizer_config.json); "
              "prompts will be encoded as plain text")
        return {}
    where = os.path.join(hf_dir, "chat_template.jinja")
    # sentinels: unique, no whitespace, none contains another
    S = {f: f"@@LAGUNA_{f.upper()}@@" for f in ("sys0", "sys", "sys_b", "user", "user_b", "user0", "reason",
                                                 "reason_b", "content", "content_b")}

    def safe(msgs, gen, think):
        try:
            return render(msgs, gen, think)
        except Exception:  # the template rejects this conversation shape: that transition stays unsupported
            return None

    def prefix_for(prev):
        return {"start": [], "start_empty": [_tok_msg("system", "")], "sys0": [_tok_msg("system", S["sys0"])],
                "sys": [_tok_msg("user", S["user0"]), _tok_msg("system", S["sys"])],
                "user": [_tok_msg("user", S["user"])],
                "asst": [_tok_msg("user", S["user0"]), _tok_msg("assistant", S["content"])],
                "asst_e": [_tok_msg("user", S["user"]), _tok_msg("assistant", "")]}[prev]

    end_marker = {"start": None, "start_empty": None, "sys0": S["sys0"], "sys": S["sys"], "user": S["user"],
                  "asst": S["content"], "asst_e": S["user"]}
    kv = {}
    for think in (0, 1):
        t = str(think)
        # does this mode show reasoning at all?
        r = safe([_tok_msg("user", S["user"]), _tok_msg("assistant", S["content"], S["reason"])], False, bool(think))
        show = r is not None and S["reason"] in r
        kv[t + ":reasoning"] = "1" if show else "0"
        for prev in _TOK_CHAT_PREVS:
            for nxt in _TOK_CHAT_NEXTS:
                if nxt == "sys0" and prev != "start":
                    continue
                if prev == "start" and nxt == "sys0":
                    msgs, gen, stop = [_tok_msg("system", S["sys0"])], False, S["sys0"]
                    prefix_msgs = []
                else:
                    prefix_msgs = prefix_for(prev)
                    gen = nxt == "gen"
                    tail = {"sys": [_tok_msg("system", S["sys_b"])], "user": [_tok_msg("user", S["user_b"])],
                            "asst_r": [_tok_msg("assistant", S["content_b"], S["reason_b"])],
                            "asst_nr": [_tok_msg("assistant", S["content_b"])]}.get(nxt, [])
                    if (nxt == "asst_r" and not show) or (prev == "start" and nxt == "sys"):
                        continue   # no such transition (a first system message is sys0)
                    msgs = prefix_msgs + tail
                    stop = {"sys": S["sys_b"], "user": S["user_b"], "asst_r": S["reason_b"],
                            "asst_nr": S["content_b"]}.get(nxt)
                out = safe(msgs, gen, bool(think))
                if out is None:
                    continue
                begin = 0
                if end_marker.get(prev) and prefix_msgs:
                    k = out.find(end_marker[prev])
                    if k < 0 or out.count(end_marker[prev]) != 1:
                        continue
                    begin = k + len(end_marker[prev])
                stop_at = len(out) if stop is None else out.find(stop, begin)
                if stop_at < 0:
                    continue
                if prev == "asst_e":   # the text after the user turn is user>asst_nr + "" + asst_e>next
                    entry = kv.get(f"{t}:user>asst_nr")
                    if entry is None or not out.startswith(entry, begin):
                        continue
                    begin += len(entry)
                kv[f"{t}:{prev}>{nxt}"] = out[begin:stop_at]
        if show:
            out = safe([_tok_msg("user", S["user"]), _tok_msg("assistant", S["content"], S["reason"])], False,
                       bool(think))
            kv[t + ":mid"] = out[out.find(S["reason"]) + len(S["reason"]):out.find(S["content"])]

    # how each field's content is stripped: render once bare and once padded with whitespace, and see which
    # padding survived
    pad_l, pad_r = " \n\t", "\t\n "
    for field in _TOK_CHAT_FIELDS:
        def conv(text):
            return {"sys0": [_tok_msg("system", text), _tok_msg("user", "u")],
                    "sys": [_tok_msg("user", "u"), _tok_msg("system", text)],
                    "user": [_tok_msg("user", text)],
                    "reason": [_tok_msg("user", "u"), _tok_msg("assistant", "a", text)],
                    "content": [_tok_msg("user", "u"), _tok_msg("assistant", text)]}[field]
        mode_found = None
        for think in (1, 0):
            bare, padded = safe(conv(S[field]), False, bool(think)), safe(conv(pad_l + S[field] + pad_r), False,
                                                                          bool(think))
            if bare is None or padded is None or S[field] not in bare:
                continue
            for mode in (0, 1, 2, 3):
                text = (pad_l if mode in (0, 2) else "") + S[field] + (pad_r if mode in (0, 1) else "")
                if bare.replace(S[field], text) == padded:
                    mode_found = mode
                    break
            else:
                raise SystemExit(f"export: {where}: the template changes {field} text in a way laguna cannot "
                                 "reproduce (not a plain strip/lstrip/rstrip).\nHINT: extend tokenizer.c's chat "
                                 "pieces, or export with --no-chat-template and send prompts as they are (laguna --raw).")
            break
        kv["strip:" + field] = str(mode_found or 0)

    # verification: pieces must reproduce jinja2 exactly on real-looking conversations
    code = "def f(x):\n    return x * 2\n"
    required = [
        [_tok_msg("user", "Hello")],
        [_tok_msg("system", "You are terse."), _tok_msg("user", "Hi\nthere")],
        [_tok_msg("system", ""), _tok_msg("user", "Hi")],
        [_tok_msg("user", "Write f."), _tok_msg("assistant", code, "The user wants f."), _tok_msg("user", "Thanks")],
        [_tok_msg("system", "Be brief."), _tok_msg("user", "a?"), _tok_msg("assistant", "b."),
         _tok_msg("user", "c?"), _tok_msg("assistant", "d.", "think d"), _tok_msg("user", "e?")],
    ]
    for msgs in required:
        for gen in (True, False):
            for think in (False, True):
                want = safe(msgs, gen, think)
                got = _tok_chat_assemble(kv, msgs, gen, think)
                if want is None or got != want:
                    raise SystemExit(
                        f"export: {where}: can't reproduce the chat template from pieces "
                        f"(enable_thinking={think}, add_generation_prompt={gen}, roles "
                        f"{[m['role'] for m in msgs]}):\n  jinja2: {want!r}\n  pieces: {got!r}\n"
                        "HINT: the template depends on more than the previous/next message; extend tokenizer.c's "
                        "chat pieces, or export with --no-chat-template and send prompts as they are (laguna --raw).")
    edge = [
        [_tok_msg("user", "q"), _tok_msg("assistant", ""), _tok_msg("user", "r")],
        [_tok_msg("user", "q"), _tok_msg("assistant", "", "why")],
        [_tok_msg("system", "  \n"), _tok_msg("user", "x")],
        [_tok_msg("user", "  padded  \n")],
        [_tok_msg("user", "q"), _tok_msg("assistant", " a \n", "")],
        [_tok_msg("user", "q"), _tok_msg("system", "later"), _tok_msg("user", "r")],
    ]
    for msgs in edge:
        for think in (False, True):
            want, got = safe(msgs, True, think), _tok_chat_assemble(kv, msgs, True, think)
            if want is not None and got is not None and want != got:
                say(f"tokenizer: warning: chat pieces differ from the template for {msgs} "
                      f"(enable_thinking={think}):\n  jinja2: {want!r}\n  pieces: {got!r}")
    return kv
# ==== tokenizer: end ====


if __name__ == "__main__":
    sys.exit(main())

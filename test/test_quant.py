"""Quantized files (export.py --dtype q8 / q4): quantize -> dequantize error bounds, the C q8/q4 kernels against
the same weights dequantized to f32 in numpy, and the loader's refusal of inconsistent quantized tensors."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES, ROOT, build_fp8_harness, run

import export

DT_NAMES = {3: "q8", 4: "q4"}


def read_file(path):
    b = open(path, "rb").read()
    magic, ver, kind, al, size, coff, csz, doff, n = struct.unpack_from("<IIIIQQQQQ", b)
    ents = []
    for i in range(n):
        name, dt, nd, s0, s1, s2, s3, off = struct.unpack_from("<80sII4qQ", b, doff + i * 128)
        ents.append((name.split(b"\0")[0].decode(), dt, tuple([s0, s1, s2, s3][:nd]), off))
    return b, kind, b[coff:coff + csz], ents, doff


def dequantize(b, dt, shape, off):
    """Read a q8 / q4 tensor the way laguna.h documents the layout (independent of export.quantize_rows)."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    cols = shape[-1]
    G = -(-cols // 32)
    if dt == 3:
        v = np.frombuffer(b, np.int8, rows * G * 32, off).reshape(rows, G, 32).astype(np.float32)
        sc = np.frombuffer(b, np.float16, rows * G, off + rows * G * 32)
    else:
        p = np.frombuffer(b, np.uint8, rows * G * 16, off).reshape(rows, G, 16)
        v = np.stack([p & 15, p >> 4], -1).reshape(rows, G, 32).astype(np.float32) - 8
        sc = np.frombuffer(b, np.float16, rows * G, off + rows * G * 16)
    return (v * sc.astype(np.float32).reshape(rows, G, 1)).reshape(rows, G * 32)[:, :cols].reshape(shape)


def dequantized_copy(src, dst):
    """The same model with every q8 / q4 tensor dequantized to f32: what the C kernels must compute."""
    b, kind, cfg, ents, _ = read_file(src)
    plan = []
    for name, dt, shape, off in ents:
        if dt in (3, 4):
            arr, odt = dequantize(b, dt, shape, off), 0
        else:
            npdt = {0: np.float32, 1: np.uint16, 2: np.uint8}[dt]
            arr, odt = np.frombuffer(b, npdt, int(np.prod(shape)), off).reshape(shape), dt
        plan.append((name, odt, shape, lambda a=arr: iter([a])))
    export.write_file(dst, cfg, plan, kind=kind, quiet=True)


@pytest.mark.parametrize("dt", [export.DT_Q8, export.DT_Q4])
@pytest.mark.parametrize("cols", [64, 100, 31])
def test_roundtrip_error_bounds(dt, cols):
    rng = np.random.default_rng(cols)
    w = rng.standard_normal((37, cols)).astype(np.float32) * rng.uniform(0.01, 3, (37, 1)).astype(np.float32)
    vals, scales, deq = export.quantize_rows(w, dt)
    G = -(-cols // 32)
    assert scales.shape == (37, G) and vals.shape == (37, G * (32 if dt == export.DT_Q8 else 16))
    # every element is within half a quantization step of the original; q4 (values -8..7, the largest magnitude
    # at -8) can clip a value of the other sign by one step
    step = np.repeat(np.abs(scales.astype(np.float32)), 32, axis=1)[:, :cols]
    err = np.abs(deq - w)
    bound = 0.5 if dt == export.DT_Q8 else 1.0
    assert (err <= bound * step * 1.01 + 1e-7).all(), float((err / step).max())
    amax = np.abs(w).max()
    rel = float(np.sqrt(np.mean((deq - w) ** 2)) / np.sqrt(np.mean(w ** 2)))
    assert rel < (0.01 if dt == export.DT_Q8 else 0.15), rel
    assert np.abs(deq).max() <= amax * 1.01


def test_fp16_scale_helpers_match_numpy(tmp_path):
    """laguna.h's fp16_value (how the CPU reads every q8 / q4 scale) decodes all 65,536 codes bit for bit as numpy's
    float16 does, subnormals and -0 included; fp16_bits (how --random-weights makes scales) rounds fp32 to fp16 as
    numpy does: ties to even, subnormals, overflow to inf, NaN stays NaN."""
    exe = build_fp8_harness(tmp_path)
    f16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    rng = np.random.default_rng(5)
    finite = f16[np.isfinite(f16)].astype(np.float32)
    pos = np.unique(np.abs(finite))                                   # 0 .. 65504 ascending
    mids = (pos[:-1].astype(np.float64) + pos[1:]) / 2                # ties (exact in fp32)
    xs = np.concatenate([finite, mids.astype(np.float32), -mids.astype(np.float32),
                         np.float32([65520.0, 65519.99, 2.0 ** -25, 2.0 ** -26, 1e-30, 1e30, np.inf, -np.inf, np.nan]),
                         np.ldexp(rng.uniform(1, 2, 20000), rng.integers(-30, 18, 20000)).astype(np.float32)])
    bits = xs.view(np.uint32)
    bits = np.concatenate([bits, bits + 1, bits - 1, rng.integers(0, 1 << 32, 5000, dtype=np.uint64).astype(np.uint32)])
    xs = bits.view(np.float32)
    out = subprocess.run([exe, "fp16"], input="".join(f"{b:08x}\n" for b in bits.tolist()), capture_output=True,
                         text=True, check=True).stdout.split()
    got_dec = np.array([int(w, 16) for w in out[:65536]], dtype=np.uint32).view(np.float32)
    want_dec = f16.astype(np.float32)
    nan = np.isnan(want_dec)
    assert np.array_equal(np.isnan(got_dec), nan)
    assert np.array_equal(got_dec[~nan].view(np.uint32), want_dec[~nan].view(np.uint32))
    got_enc = np.array([int(w, 16) for w in out[65536:]], dtype=np.uint32).astype(np.uint16)
    assert len(got_enc) == len(xs)
    with np.errstate(over="ignore", invalid="ignore"):
        want_enc = xs.astype(np.float16)
    nan = np.isnan(want_enc)
    assert np.array_equal(np.isnan(got_enc.view(np.float16)), nan)
    bad = np.flatnonzero(got_enc[~nan] != want_enc[~nan].view(np.uint16))
    print(f"\nfp16: 65,536 codes decoded; {len(xs)} fp32 inputs rounded, {len(bad)} mismatches")
    assert len(bad) == 0, [(float(xs[~nan][i]), hex(got_enc[~nan][i])) for i in bad[:10]]


@pytest.mark.parametrize("dtype", ["q8", "q4"])
@pytest.mark.parametrize("name", ["xs2_f32", "xs21_bf16", "variant"])
def test_quantized_kernels_equal_dequantized_weights(laguna, exported, tmp_path, name, dtype):
    q = exported(name, "--dtype", dtype)
    deq = str(tmp_path / "deq.bin")
    dequantized_copy(q, deq)
    score = f"{FIXTURES}/{name}/score.txt"
    out = {}
    for key, path in (("q", q), ("deq", deq)):
        run([laguna, path, "--score", score, "--logits", str(tmp_path / f"logits_{key}.bin"), "-q"])
        out[key] = np.fromfile(tmp_path / f"logits_{key}.bin", dtype=np.float32)
    diff = float(np.abs(out["q"] - out["deq"]).max())
    print(f"\n{name} {dtype}: max |logit(q kernels) - logit(dequantized f32)| = {diff:.3g}")
    assert diff <= 1e-4
    # the file really is quantized, embedding q8, router kept
    _, _, _, ents, _ = read_file(q)
    kinds = {n: dt for n, dt, _, _ in ents}
    assert kinds["model.embed_tokens.weight"] == 3
    assert kinds["model.layers.1.self_attn.q_proj.weight"] == (3 if dtype == "q8" else 4)
    assert kinds["model.layers.2.mlp.gate.weight"] in (0, 1)


def test_quantized_drafter_runs_losslessly(laguna, exported):
    prompt = open(f"{FIXTURES}/xs2_f32/prompt.txt").read().strip()
    want = run([laguna, exported("xs2_f32"), "--ids", prompt, "-t", "0", "-n", "20", "-q"]).stdout
    got = run([laguna, exported("xs2_f32"), "-d", exported("draft_xs2", "--dtype", "q4"), "--ids", prompt, "-t", "0",
               "-n", "20", "-q"]).stdout
    assert got == want


def test_loader_refuses_inconsistent_quantized_tensor(laguna, exported, tmp_path):
    from test_model import expect_error
    b, _, _, ents, doff = read_file(exported("xs2_f32", "--dtype", "q8"))
    data = bytearray(b)
    for i, (name, dt, shape, off) in enumerate(ents):
        if name == "model.layers.1.self_attn.o_proj.weight":
            struct.pack_into("<I", data, doff + i * 128 + 80, 1)   # claims bf16: the sizes no longer add up
    p = tmp_path / "bad.bin"
    p.write_bytes(bytes(data))
    expect_error([laguna, str(p), "--ids", "1 2"], "o_proj")
    # a quantized tensor whose columns are not what the config says
    data = bytearray(b)
    for i, (name, dt, shape, off) in enumerate(ents):
        if name == "model.layers.2.self_attn.k_proj.weight":
            struct.pack_into("<q", data, doff + i * 128 + 96, 65)
    p.write_bytes(bytes(data))
    expect_error([laguna, str(p), "--ids", "1 2"], "k_proj")


def hash_weights(seed, name, shape):
    """laguna.h's --random-weights values in numpy: uniform of std 1/sqrt(fan_in) from a counter hash of (seed,
    FNV-1a of the name, element index), rounded to bf16 (as float32)."""
    def splitmix(x):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
    key = 0xcbf29ce484222325
    for ch in name.encode():
        key = ((key ^ ch) * 0x100000001b3) & ((1 << 64) - 1)
    base = splitmix(np.array([seed ^ key], dtype=np.uint64))
    h = splitmix(base + np.arange(int(np.prod(shape)), dtype=np.uint64))
    s = (h >> np.uint64(40)).astype(np.int64) - (1 << 23)
    a = np.sqrt(np.float32(3.0) / np.float32(shape[-1]))
    v = s.astype(np.float32) * (a * np.float32(1.0 / 8388608.0))
    u = v.view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32).reshape(shape)


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_random_weights_on_quantized_file_are_the_quantized_hash_values(laguna, exported, tmp_path, dtype):
    """--random-weights on a q8 / q4 file (the GPU benchmark's synthetic files) fills every matmul weight with
    export.py's quantization of the bf16 hash values (laguna.cu fills the same bytes on the device): the logits
    equal those of a file written here with those weights."""
    q = exported("xs2_f32", "--dtype", dtype)
    b, _, _, ents, _ = read_file(q)
    data = bytearray(b)
    for name, dt, shape, off in ents:
        if len(shape) < 2 or dt not in (0, 1, 3, 4):
            continue
        w = hash_weights(1, name, shape)
        if dt in (3, 4):
            vals, sc, _ = export.quantize_rows(w.reshape(-1, shape[-1]), dt)
            raw = vals.tobytes() + sc.view(np.uint16).tobytes()
        else:
            raw = (w if dt == 0 else (w.view(np.uint32) >> 16).astype(np.uint16)).tobytes()
        data[off:off + len(raw)] = raw
    want = tmp_path / "want.bin"
    want.write_bytes(bytes(data))
    score = f"{FIXTURES}/xs2_f32/score.txt"
    out = {}
    for key, path, extra in (("hook", q, ["--random-weights", "1"]), ("file", str(want), []), ("plain", q, [])):
        run([laguna, path, "--score", score, "--logits", str(tmp_path / f"{key}.bin"), "-q", *extra])
        out[key] = np.fromfile(tmp_path / f"{key}.bin", dtype=np.float32)
    assert np.array_equal(out["hook"], out["file"])
    assert not np.array_equal(out["hook"], out["plain"])


def test_reexporting_a_laguna_file_equals_exporting_its_checkpoint(exported, tmp_path):
    """export.py FILE.bin OUT.bin --dtype D (how models/tiny.bin is quantized) writes what exporting the checkpoint at
    D writes, for a target and a drafter; bf16 -> f32 -> bf16 comes back bit for bit; a quantized or foreign source
    is refused."""
    from test_model import expect_error

    def reexport(src, dtype, name):
        out = str(tmp_path / name)
        run([sys.executable, os.path.join(ROOT, "export.py"), "-q", src, out, "--dtype", dtype])
        return out

    f32 = exported("xs2_f32")
    for dtype in ("bf16", "q8", "q4"):
        got = open(reexport(f32, dtype, f"xs2_{dtype}.bin"), "rb").read()
        assert got == open(exported("xs2_f32", "--dtype", dtype), "rb").read(), dtype
    bf16 = exported("xs2_f32", "--dtype", "bf16")
    back = reexport(reexport(bf16, "f32", "up.bin"), "bf16", "down.bin")
    assert open(back, "rb").read() == open(bf16, "rb").read()
    assert open(reexport(bf16, "auto", "same.bin"), "rb").read() == open(bf16, "rb").read()
    d = reexport(exported("draft_xs2"), "q8", "draft_q8.bin")
    assert open(d, "rb").read() == open(exported("draft_xs2", "--dtype", "q8"), "rb").read()
    cmd = [sys.executable, os.path.join(ROOT, "export.py"), "-q"]
    expect_error(cmd + [exported("xs2_f32", "--dtype", "q8"), str(tmp_path / "x.bin"), "--dtype", "q4"],
                 "already quantized", "export from the checkpoint")
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"GGUF" + bytes(60))
    expect_error(cmd + [str(foreign), str(tmp_path / "y.bin")], "is not a laguna file")

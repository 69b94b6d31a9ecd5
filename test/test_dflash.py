"""DFlash speculative decoding on the CPU: the drafter against the PyTorch reference (dev/dflash_ref.py) on
transformers' target taps, lossless greedy and sampled generation, rollback, and drafter/target mismatches."""
import math
import os
import struct

import numpy as np
import pytest

from conftest import FIXTURES, run

TOL = 1e-4


def fx(*p):
    return os.path.join(FIXTURES, *p)


def ids_of(path):
    return open(path).read().split()


@pytest.fixture(scope="module")
def models(exported):
    return {"xs2": exported("xs2_f32"), "dxs2": exported("draft_xs2"),
            "v16": exported("v16"), "dv16": exported("draft_v16")}


@pytest.mark.parametrize("target,drafter,fixture,checks", [
    ("xs2", "dxs2", "draft_xs2", [5, 20, 40]),      # causal, sliding window 12, 3 taps (the last = last layer)
    ("v16", "dv16", "draft_v16", [3, 12]),          # non-causal block, full attention, per-element gate
])
def test_drafter_matches_reference_module(laguna, models, tmp_path, target, drafter, fixture, checks):
    score = ids_of(fx(fixture.replace("draft_", "").replace("xs2", "xs2_f32"), "score.txt"))
    for P in checks:
        out = tmp_path / "dl.bin"
        run([laguna, models[target], "-d", models[drafter], "--ids", " ".join(score[:P + 1]), "--draft-logits",
             str(out), "-q"])
        ref = np.load(fx(fixture, f"draft_logits_{P}.npy"))
        got = np.fromfile(out, dtype=np.float32).reshape(ref.shape)
        diff = float(np.abs(got - ref).max())
        print(f"\n{fixture} P={P}: max |draft logit - reference| = {diff:.3g} (bar {TOL})")
        assert diff <= TOL


def test_taps_equal_transformers_layer_outputs(laguna, models, tmp_path):
    out = tmp_path / "taps.bin"
    run([laguna, models["xs2"], "-d", models["dxs2"], "--score", fx("xs2_f32", "score.txt"), "--taps", str(out),
         "-q"])
    ref = np.load(fx("draft_xs2", "taps.npy"))          # transformers: layer outputs 1, 4, 7 (7 = last, pre-norm)
    got = np.fromfile(out, dtype=np.float32).reshape(ref.shape)
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"\ntaps: max |diff| / max |ref| = {rel:.3g}")
    assert rel <= 1e-5


def generate(laguna, target, prompt, *extra):
    r = run([laguna, target, "--ids", prompt, "-t", "0", *extra])
    return r.stdout.split(), r.stderr


def test_greedy_is_lossless_for_every_draft_length(laguna, models):
    """Identical tokens with and without the drafter: prompts shorter and longer than the target window (8)
    and the drafter window (12), generations crossing many block boundaries, --draft-max 1..15."""
    score = ids_of(fx("xs2_f32", "score.txt"))
    for plen in (1, 7, 8, 9, 13, 30):
        prompt = " ".join(score[:plen])
        want, _ = generate(laguna, models["xs2"], prompt, "-n", "45", "-q")
        for k in range(1, 16):
            got, _ = generate(laguna, models["xs2"], prompt, "-n", "45", "-q", "-d", models["dxs2"],
                              "--draft-max", str(k))
            assert got == want, (plen, k)


def test_greedy_lossless_with_acceptances_and_rollback(laguna, models, tmp_path):
    """On the 16-token vocabulary random drafts are often right, so blocks get partly accepted and the target
    cache is rolled back mid-block. After every accept length the logits the loop used must equal a fresh
    teacher-forced pass over the committed text."""
    score = ids_of(fx("v16", "score.txt"))
    accepted = 0
    for plen in (2, 5, 12):
        prompt = " ".join(score[:plen])
        want, _ = generate(laguna, models["v16"], prompt, "-n", "60", "-q")
        trace = tmp_path / "trace.bin"
        got, err = generate(laguna, models["v16"], prompt, "-n", "60", "-d", models["dv16"], "--logits", str(trace))
        assert got == want
        accepted += int(err.split(" accepted,")[0].split()[-1])
        # the rows behind each generated token vs a fresh --score over prompt + generated
        seq = tmp_path / "seq.txt"
        seq.write_text(" ".join(score[:plen] + got))
        full = tmp_path / "full.bin"
        run([laguna, models["v16"], "--score", str(seq), "--logits", str(full), "-q"])
        fresh = np.fromfile(full, dtype=np.float32).reshape(-1, 16)[plen - 1: plen - 1 + len(got)]
        used = np.fromfile(trace, dtype=np.float32).reshape(-1, 16)[: len(got)]
        assert float(np.abs(used - fresh).max()) <= TOL
    print(f"\naccepted drafts over the runs: {accepted}")
    assert accepted > 0


def exact_second_token(laguna, model, prompt, temperature, topp, tmp_path, vocab=16, eos=15):
    """p(t2) = sum_t1 p(t1 | prompt) p(t2 | prompt t1), with the sampler's temperature and top-p (t1 = eos ends the
    run before a second token: left out, as second_tokens leaves out such runs)."""
    def dist(row):
        z = row.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        if 0 < topp < 1:
            order = np.argsort(-p, kind="stable")
            keep = np.searchsorted(np.cumsum(p[order]), topp, side="right") + 1
            q = np.zeros_like(p)
            q[order[:keep]] = p[order[:keep]]
            p = q / q.sum()
        return p
    p2 = np.zeros(vocab)
    seq = tmp_path / "s.txt"
    lg = tmp_path / "l.bin"
    for t1 in range(vocab):
        if t1 == eos:
            continue
        seq.write_text(prompt + f" {t1}")
        run([laguna, model, "--score", str(seq), "--logits", str(lg), "-q"])
        rows = np.fromfile(lg, dtype=np.float32).reshape(-1, vocab)
        p2 += dist(rows[-2])[t1] * dist(rows[-1])
    return p2 / p2.sum()


def second_tokens(stdout, vocab=16, eos=15):
    """Counts of the second generated token over --samples lines; EOS ends a line without being printed,
    so a one-token line means the second token was EOS and an empty line (first token EOS) is left out."""
    c = np.zeros(vocab)
    for line in stdout.split("\n")[:-1]:
        toks = line.split()
        if len(toks) >= 2:
            c[int(toks[1])] += 1
        elif len(toks) == 1:
            c[eos] += 1
    return c


def chi2_stat(counts, expected):
    """Pearson's statistic with bins of expected count < 5 pooled; returns (stat, degrees of freedom)."""
    big = expected >= 5
    c = list(counts[big]) + ([counts[~big].sum()] if (~big).any() else [])
    e = list(expected[big]) + ([expected[~big].sum()] if (~big).any() else [])
    stat = sum((ci - ei) ** 2 / ei for ci, ei in zip(c, e) if ei > 0)
    return stat, len(c) - 1


def chi2_critical(df, z=3.09):
    """Wilson-Hilferty: the chi-square quantile at normal quantile z (3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature,topp", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_with_drafter_keeps_the_target_distribution(laguna, models, tmp_path, temperature, topp):
    """The second generated token is the first one a draft can decide. Its empirical distribution over many
    seeded runs must match the exact one; a deliberately biased acceptance rule must fail the same test."""
    prompt = " ".join(ids_of(fx("v16", "score.txt"))[:6])
    exact = exact_second_token(laguna, models["v16"], prompt, temperature, topp, tmp_path)
    N = 3000

    def counts(env=None):
        r = run([laguna, models["v16"], "-d", models["dv16"], "--ids", prompt, "-n", "2", "-t", str(temperature),
                 "-p", str(topp), "-s", "11", "--samples", str(N), "-q"], env=env)
        assert r.stdout.count("\n") == N
        c = second_tokens(r.stdout)
        return c, c.sum()

    c, n = counts()
    stat, df = chi2_stat(c, exact * n)
    print(f"\nT={temperature} top-p={topp}: chi2 {stat:.1f} with {df} dof (critical {chi2_critical(df):.1f})")
    assert stat < chi2_critical(df)
    c, n = counts(dict(os.environ, LAGUNA_TEST_BIASED_ACCEPT="1"))
    stat_b, df_b = chi2_stat(c, exact * n)
    print(f"biased acceptance: chi2 {stat_b:.1f} with {df_b} dof")
    assert stat_b > chi2_critical(df_b)


def test_without_drafter_sampling_matches_too(laguna, models, tmp_path):
    """The same statistic without the drafter (the sampler itself is right)."""
    prompt = " ".join(ids_of(fx("v16", "score.txt"))[:6])
    exact = exact_second_token(laguna, models["v16"], prompt, 1.0, 1.0, tmp_path)
    r = run([laguna, models["v16"], "--ids", prompt, "-n", "2", "-t", "1.0", "-p", "1.0", "-s", "5",
             "--samples", "3000", "-q"])
    c = second_tokens(r.stdout)
    stat, df = chi2_stat(c, exact * c.sum())
    assert stat < chi2_critical(df)


def test_report_and_compare(laguna, models):
    prompt = " ".join(ids_of(fx("v16", "score.txt"))[:5])
    r = run([laguna, models["v16"], "-d", models["dv16"], "--ids", prompt, "-t", "0", "-n", "30", "--compare"])
    for phrase in ("verify steps", "drafted", "accepted", "acceptance", "mean length tau",
                   "acceptance per block position", "speedup", "outputs identical"):
        assert phrase in r.stderr, phrase


# ---------------------------------------------------------------------------------------------
# a drafter that does not fit the target is refused

def test_mismatched_drafters_are_refused(laguna, models, exported, tmp_path):
    from test_model import expect_error
    expect_error([laguna, models["v16"], "-d", models["dxs2"], "--ids", "1 2"], "vocabulary (512)", "(16)")
    expect_error([laguna, exported("variant"), "-d", models["dxs2"], "--ids", "1 2"], "8-layer target")
    # the same drafter with the target-layer count erased: the tap range check speaks
    data = open(models["dxs2"], "rb").read().replace(b"dflash_num_target_layers=8", b"dflash_num_target_layers=0")
    p = tmp_path / "d.bin"
    p.write_bytes(data)
    expect_error([laguna, exported("variant"), "-d", str(p), "--ids", "1 2"], "taps target layer 7")
    # a block size past what export.py writes (2..64)
    p.write_bytes(open(models["dxs2"], "rb").read().replace(b"dflash_block_size=16\n", b"dflash_block_size=99\n"))
    expect_error([laguna, models["xs2"], "-d", str(p), "--ids", "1 2"], "block size outside 2..64 (99)")
    expect_error([laguna, models["xs2"], "-d", models["xs2"], "--ids", "1 2"], "not a DFlash drafter")
    expect_error([laguna, models["dxs2"], "--ids", "1 2"], "is a DFlash drafter")
    expect_error([laguna, exported("xs21_bf16"), "-d", models["dxs2"], "--ids", "1 2"], "(512)")
    # a drafter of the target's vocabulary and depth but another hidden size (its weights written from the
    # shapes export.py expects, so only the width differs)
    expect_error([laguna, models["xs2"], "-d", drafter_of_width(tmp_path, 32), "--ids", "1 2"],
                 "hidden size (32) does not match the target's (64)", "trained for this model")


def drafter_of_width(tmp_path, hidden):
    """draft_xs2 at another hidden size, with random weights of the shapes export.py expects for it, exported."""
    import json
    from safetensors.numpy import save_file
    import export
    cfg = dict(json.loads(open(fx("draft_xs2", "hf", "config.json")).read()), hidden_size=hidden)
    rng = np.random.default_rng(0)
    weights = {k: rng.standard_normal(s).astype(np.float32)
               for k, s in export.SyntheticCheckpoint(cfg, "random").shapes.items()}
    return exported_drafter_variant(tmp_path / f"width{hidden}", edit_config=lambda c: c.update(hidden_size=hidden),
                                    edit_tensors=lambda t, path: save_file(weights, path))


def test_small_chunk_is_raised_for_the_verify_block(laguna, models):
    """--chunk below a verify block is raised to 64 with a note, and the output stays the target's own."""
    prompt = " ".join(ids_of(fx("xs2_f32", "score.txt"))[:20])
    want, _ = generate(laguna, models["xs2"], prompt, "-n", "20", "-q", "--chunk", "4")
    got, err = generate(laguna, models["xs2"], prompt, "-n", "20", "-d", models["dxs2"], "--chunk", "4")
    assert got == want and "--chunk 4 raised to 64 with a drafter" in err


def test_export_refuses_broken_drafters(tmp_path):
    import json
    import shutil
    import sys
    from safetensors.numpy import load_file, save_file
    from test_model import expect_error, ROOT
    d = tmp_path / "d"
    shutil.copytree(fx("draft_xs2", "hf"), d)
    cmd = [sys.executable, os.path.join(ROOT, "export.py"), str(d), str(tmp_path / "o.bin")]
    t = load_file(str(d / "model.safetensors"))
    t.pop("aux_hidden_norms.1.weight")
    save_file(t, str(d / "model.safetensors"))
    expect_error(cmd, "aux_hidden_norms.1.weight", "missing")
    shutil.rmtree(d)
    shutil.copytree(fx("draft_xs2", "hf"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    (d / "config.json").write_text(json.dumps(cfg))
    expect_error(cmd, "layer_types", "mixes attention types", "mixed layer types")
    for lt, phrase in ((["sliding_attention"] * 3, "3 entries for 2 layers"),
                       (["chunked_attention"] * 2, "'chunked_attention' is not supported")):
        cfg["layer_types"] = lt
        (d / "config.json").write_text(json.dumps(cfg))
        expect_error(cmd, phrase)


def test_drafter_config_spellings_vllm_reads_alike(tmp_path):
    """Config spellings vLLM resolves to the same drafter export to the same file: taps given as
    eagle_aux_hidden_state_layer_ids (the state entering layer k: tap k - 1) with or without target_layer_ids,
    a sliding drafter without dflash_config.causal (vLLM: sliding layers are causal), a top-level is_causal,
    rope_scaling (transformers' alias of rope_parameters) in place of rope_parameters, the RoPE nested by layer type
    or with its theta at the top level, and swa_rope_parameters (they set a sliding drafter's RoPE)."""
    base = open(exported_drafter_variant(tmp_path / "base"), "rb").read()
    edits = {
        "eagle_and_taps": lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 5, 8]),
        "eagle_only": lambda c: (c.update(eagle_aux_hidden_state_layer_ids=[2, 5, 8]),
                                 c["dflash_config"].pop("target_layer_ids")),
        "causal_absent": lambda c: c["dflash_config"].pop("causal"),
        "is_causal": lambda c: (c["dflash_config"].pop("causal"), c.update(is_causal=True)),
        "rope_scaling": lambda c: c.update(rope_scaling=c.pop("rope_parameters")),
        # the older config's switches at Laguna's values (the router's at any: a drafter has no MoE)
        "switches": lambda c: c.update(qkv_bias=False, swa_attention_sink_enabled=False, rope_style="rotate-half",
                                       moe_router_use_sigmoid=False),
        # RoPE nested by layer type, or under full_attention only (vLLM falls back to it), or with rope_theta at the
        # top level; and swa_rope_parameters, which set a sliding drafter's RoPE whatever rope_parameters says
        "rope_nested": lambda c: c.update(rope_parameters={"sliding_attention": c["rope_parameters"]}),
        "rope_nested_full": lambda c: c.update(rope_parameters={"full_attention": c["rope_parameters"]}),
        "rope_theta_top": lambda c: c.update(rope_theta=c["rope_parameters"].pop("rope_theta")),
        "swa_rope": lambda c: c.update(swa_rope_parameters=c["rope_parameters"],
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
    }
    for name, edit in edits.items():
        got = open(exported_drafter_variant(tmp_path / name, edit_config=edit), "rb").read()
        assert got == base, name
    # and the spellings that mean something else give another file: non-causal, other RoPE
    for name, edit in {"is_causal_false": lambda c: c.update(is_causal=False),
                       "rope_scaling_wins": lambda c: c.update(rope_scaling={"rope_type": "default",
                                                                              "rope_theta": 1000.0}),
                       "swa_rope_wins": lambda c: c.update(swa_rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 1000.0})}.items():
        assert open(exported_drafter_variant(tmp_path / name, edit_config=edit), "rb").read() != base, name


def test_export_refuses_drafter_configs_it_cannot_read(tmp_path):
    import json
    import shutil
    import sys
    from test_model import expect_error, ROOT
    cases = [(lambda c: c["dflash_config"].update(sliding_window_non_causal=True), "dflash_config has keys"),
             (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]), "name different taps"),
             (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 5, 8]), "embeddings"),
             (lambda c: c.pop("layer_types"), "no layer_types"),
             (lambda c: c.update(sliding_window=None), "sliding_window is null"),
             (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "pre-quantized checkpoint"),
             (lambda c: c.update(qkv_bias=True), "sets qkv_bias = true")]
    for i, (edit, phrase) in enumerate(cases):
        d = tmp_path / f"d{i}"
        shutil.copytree(fx("draft_xs2", "hf"), d)
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        expect_error([sys.executable, os.path.join(ROOT, "export.py"), str(d), str(tmp_path / "o.bin")], phrase)
    # --ignore-key dflash_config.KEY vouches for a nested key
    run([sys.executable, os.path.join(ROOT, "export.py"), "-q", str(tmp_path / "d0"), str(tmp_path / "o.bin"),
         "--ignore-key", "dflash_config.sliding_window_non_causal"])


def test_draft_logits_past_the_context_refused(laguna, models, tmp_path):
    from test_model import expect_error
    prompt = " ".join(ids_of(fx("xs2_f32", "score.txt"))[:9])
    expect_error([laguna, models["xs2"], "-d", models["dxs2"], "--ids", prompt, "-c", "10",
                  "--draft-logits", str(tmp_path / "o.bin")], "pass the context")


def write_bf16_safetensors(tensors, path):
    """safetensors with every tensor in bf16 (numpy has no bf16: written by hand, round-to-nearest-even)."""
    import json
    import export
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        raw = export.f32_to_bf16(tensors[name].astype(np.float32)).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def exported_drafter_variant(tmp_path, edit_config=None, edit_tensors=None):
    """draft_xs2 with its config and/or tensors changed, exported; returns the .bin path."""
    import json
    import shutil
    import sys
    from safetensors.numpy import load_file
    from test_model import ROOT
    d = tmp_path / "variant"
    shutil.copytree(fx("draft_xs2", "hf"), d)
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        path = str(d / "model.safetensors")
        edit_tensors(load_file(path), path)        # writes the changed tensors back to path
    out = str(tmp_path / "d.bin")
    run([sys.executable, os.path.join(ROOT, "export.py"), "-q", str(d), out])
    return out


def assert_lossless(laguna, models, drafter, n_prompt=20, n=30):
    prompt = " ".join(ids_of(fx("xs2_f32", "score.txt"))[:n_prompt])
    want, _ = generate(laguna, models["xs2"], prompt, "-n", str(n), "-q")
    got, _ = generate(laguna, models["xs2"], prompt, "-n", str(n), "-q", "-d", drafter)
    assert got == want


def test_random_drafters_match_the_reference(laguna):
    """dev/dflash_fuzz.py: random drafter configs (layers, GQA groups, head dims, gating kinds, window or full
    attention, every causality spelling vLLM reads, block sizes, mask token, taps as target or eagle ids, RoPE, "model."
    prefixes) on the fixtures' targets, written in the on-disk layout and exported: laguna's draft logits within 1e-4
    of dev/dflash_ref.py on laguna's taps, and the taps within 1e-5 (relative) of transformers'. Needs torch."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import subprocess
    import sys
    from conftest import ROOT
    r = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "dflash_fuzz.py"), "24", "11"], capture_output=True,
                       text=True, env=dict(os.environ, LAGUNA=laguna))
    lines = [line for line in r.stdout.splitlines() if line.startswith(("config", "24 drafters"))]
    print("\n" + lines[-1] if lines else "")
    assert r.returncode == 0, "\n".join(line for line in lines if " ok " not in line)[-3000:] + r.stderr[-2000:]


def test_all_bf16_drafter_checkpoint(laguna, models, tmp_path):
    """The released drafter is bf16 throughout (norms too): export keeps norms f32 and it runs losslessly."""
    out = exported_drafter_variant(tmp_path, edit_tensors=lambda t, path: write_bf16_safetensors(t, path))
    assert_lossless(laguna, models, out)


def test_drafter_with_gating_disabled(laguna, models, tmp_path):
    """vLLM's Laguna drafter allows gating false / "disabled" (no g_proj): export and run it, losslessly."""
    from safetensors.numpy import save_file
    out = exported_drafter_variant(
        tmp_path, edit_config=lambda c: c.update(gating=False),
        edit_tensors=lambda t, path: save_file({k: v for k, v in t.items() if "g_proj" not in k}, path))
    assert_lossless(laguna, models, out, n_prompt=10, n=20)


def test_drafter_checkpoint_with_its_own_embedding(laguna, models, tmp_path):
    """Some drafter copies carry embed_tokens / lm_head: like vLLM, laguna uses the target's instead."""
    import numpy as np
    from safetensors.numpy import save_file

    def add(t, path):
        t["model.embed_tokens.weight"] = np.zeros((512, 64), np.float32)
        t["lm_head.weight"] = np.zeros((512, 64), np.float32)
        save_file(t, path)
    assert_lossless(laguna, models, exported_drafter_variant(tmp_path, edit_tensors=add))


def test_synthetic_drafter_preset(laguna, models, tmp_path):
    """export.py --synthetic XS-2.1-DFlash (the benchmark's drafter) writes the published drafter's config and shapes:
    it loads (every tensor bound) and is refused by a target it does not fit."""
    import sys
    from test_model import ROOT, expect_error
    out = tmp_path / "xs21-dflash.bin"
    run([sys.executable, os.path.join(ROOT, "export.py"), "-q", "--synthetic", "XS-2.1-DFlash", str(out)])
    head = open(out, "rb").read(4096)
    kind, = struct.unpack_from("<I", head, 8)
    coff, csize = struct.unpack_from("<QQ", head, 24)
    cfg = dict(line.split("=", 1) for line in head[coff:coff + csize].decode().splitlines())
    assert kind == 1
    for k, v in {"hidden_size": "2048", "n_layers": "5", "n_heads": "64 64 64 64 64", "n_kv_heads": "8",
                 "head_dim": "128", "intermediate_size": "8192", "sliding_window": "512", "gating": "per-head",
                 "mask_token_id": "12", "dflash_block_size": "16", "dflash_target_layer_ids": "1 13 25 33 39",
                 "dflash_causal": "1", "dflash_num_target_layers": "40"}.items():
        assert cfg[k] == v, (k, cfg[k])
    expect_error([laguna, models["xs2"], "-d", str(out), "--ids", "1 2"], "vocabulary (100352)")
    # --dtype q8 / q4: every matrix a hole of its quantized size (q8: 34 bytes a group of 32, q4: 18), which the
    # loader binds (it checks every size) before it compares the drafter with the target
    for dt, code, group_bytes in (("q8", 3, 34), ("q4", 4, 18)):
        q = tmp_path / f"xs21-dflash-{dt}.bin"
        run([sys.executable, os.path.join(ROOT, "export.py"), "-q", "--synthetic", "XS-2.1-DFlash", "--dtype", dt, str(q)])
        with open(q, "rb") as f:
            head = f.read(1 << 20)
        doff, n = struct.unpack_from("<QQ", head, 40)
        ents = [struct.unpack_from("<80sII4qQ", head, doff + i * 128) for i in range(n)]
        mats = [(e[0].split(b"\0")[0].decode(), e[1], e[3:3 + e[2]]) for e in ents if e[2] == 2]
        assert len(mats) == 5 * 8 + 1 and all(m[1] == code for m in mats), mats[:3]   # 5 layers x 8, fc
        sizes = sorted((e[-1], e) for e in ents)
        for (o0, e0), (o1, _) in zip(sizes, sizes[1:]):
            if e0[2] == 2:
                assert o1 - o0 >= e0[3] * -(-e0[4] // 32) * group_bytes, e0[0]
        expect_error([laguna, models["xs2"], "-d", str(q), "--ids", "1 2"], "vocabulary (100352)")


def test_random_weights_fill_the_drafter_too(laguna, models, tmp_path):
    """--random-weights SEED replaces the drafter's matmul weights as well as the target's (benchmarks on synthetic
    pairs): a drafter whose MLP weights are doubled then drafts exactly like the original."""
    from safetensors.numpy import save_file
    doubled = exported_drafter_variant(tmp_path, edit_tensors=lambda t, path: save_file(
        {k: (v * 2 if ".mlp." in k else v) for k, v in t.items()}, path))
    prompt = " ".join(ids_of(fx("xs2_f32", "score.txt"))[:10])

    def dl(drafter, *extra):
        out = tmp_path / "dl.bin"
        run([laguna, models["xs2"], "-d", drafter, "--ids", prompt, "--draft-logits", str(out), "-q", *extra])
        return np.fromfile(out, dtype=np.float32)
    assert not np.allclose(dl(models["dxs2"]), dl(doubled))
    assert np.array_equal(dl(models["dxs2"], "--random-weights", "1"), dl(doubled, "--random-weights", "1"))

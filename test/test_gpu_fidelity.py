"""bf16 fidelity at the real Laguna-XS-2.1 widths, judged against the official implementation.

A random model with 256 near-tied experts is chaotic: a 0.4% rounding of one K/V value can flip one expert of
one token, and a flipped route moves that token's logits by O(1). So "top-1 agreement with fp32" on such a model
measures the model's sensitivity as much as the program's accuracy. This test measures both on the same weights:

  reference  transformers LagunaForCausalLM in fp32 (eager attention) on the GPU: the math the CPU path matches
             to 1e-5 on every fixture (test_model.py)
  official   the same model in bf16, as transformers runs it (its default attention, bf16 activations)
  laguna     ./laguna on the GPU as shipped (bf16 weights, fp32 activations, bf16 KV cache), one pass and one
             token at a time; and with --kv f32 (fp32 KV cache)

and asserts: laguna's bf16 path agrees with the reference at least as well as the official bf16 path does (no
fidelity regression), and laguna with an fp32 KV cache reaches the issue's 99.5% top-1 bar.
GPU only (make test-gpu); needs torch + transformers >= 5.17. Takes about a minute on an H200.
"""
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, run
from test_gpu import have_gpu, laguna_gpu, score  # noqa: F401  (laguna_gpu is a fixture)

pytestmark = pytest.mark.skipif(not have_gpu(), reason="no NVIDIA GPU / nvcc here (CI): GPU tests skipped")

LAYERS, N_TOKENS = 4, 1536      # dense + 3 MoE layers, 1 full : 3 sliding; three 512-token windows


def top1(a, b):
    return float((a.argmax(-1) == b.argmax(-1)).mean())


def test_gpu_bf16_fidelity_vs_official(laguna_gpu, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, ROOT)
    import export

    cfg = dict(export.SYNTHETIC["XS-2.1"], num_hidden_layers=LAYERS)
    for k in ("num_attention_heads_per_layer", "layer_types", "mlp_layer_types"):
        cfg[k] = cfg[k][:LAYERS]
    cfg.pop("model_type"), cfg.pop("architectures")
    torch.manual_seed(0)
    with torch.device("cuda"):                  # 2.4B random parameters: initialise them on the GPU
        model = transformers.LagunaForCausalLM(transformers.LagunaConfig(**cfg))
    big = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    hf = os.path.join(big, "laguna_fidelity_hf")
    mid = os.path.join(big, "laguna_fidelity.bin")
    # a bf16 checkpoint, like the real one. Both transformers runs load it back with from_pretrained, as users do:
    # model.to(bfloat16) would also round the rotary inv_freq buffers, which from_pretrained computes afresh
    model.to(torch.bfloat16).save_pretrained(hf)
    del model
    try:
        run([sys.executable, os.path.join(ROOT, "export.py"), "-q", hf, mid])
        ids = np.random.default_rng(0).integers(3, cfg["vocab_size"], size=N_TOKENS)
        x = torch.tensor(ids, device="cuda")[None]
        load = transformers.LagunaForCausalLM.from_pretrained
        with torch.no_grad():
            model = load(hf, dtype=torch.bfloat16).cuda()
            official = model(x).logits[0].float().cpu().numpy()
            del model
            model = load(hf, dtype=torch.float32, attn_implementation="eager").cuda()
            ref = model(x).logits[0].float().cpu().numpy()
            del model
        torch.cuda.empty_cache()

        ids_file = tmp_path / "ids.txt"
        ids_file.write_text(" ".join(map(str, ids)))
        runs = {
            "laguna bf16 KV, one pass": score(laguna_gpu, mid, str(ids_file), tmp_path, "-c", "4096")[0],
            "laguna bf16 KV, one token at a time": score(laguna_gpu, mid, str(ids_file), tmp_path, "-c", "4096",
                                                         "--chunk", "1")[0],
            "laguna f32 KV, one token at a time": score(laguna_gpu, mid, str(ids_file), tmp_path, "-c", "4096",
                                                        "--chunk", "1", "--kv", "f32")[0],
        }
        print(f"\n[fidelity] XS-2.1 widths x{LAYERS} layers, random weights, {N_TOKENS} tokens; "
              f"vs transformers fp32 (logit std {ref.std():.3g}):")
        t_off = top1(official, ref)
        print(f"  {'transformers bf16 (official)':40s} top-1 {100 * t_off:6.2f}%  max |diff| "
              f"{np.abs(official - ref).max():.3g}")
        res = {}
        for label, lg in runs.items():
            res[label] = top1(lg, ref)
            print(f"  {label:40s} top-1 {100 * res[label]:6.2f}%  max |diff| {np.abs(lg - ref).max():.3g}")
        for label in ("laguna bf16 KV, one pass", "laguna bf16 KV, one token at a time"):
            assert res[label] >= t_off - 0.005, f"{label}: {res[label]:.4f} < official bf16 {t_off:.4f}"
        assert res["laguna f32 KV, one token at a time"] >= 0.995
    finally:
        for p in (mid,):
            if os.path.exists(p):
                os.remove(p)
        import shutil
        shutil.rmtree(hf, ignore_errors=True)

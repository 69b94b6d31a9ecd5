"""Every hyperparameter and seed of the tiny Laguna + DFlash training, in one place.

    from config import get;  C = get(smoke)        # a plain dict; smoke=True: the CPU toy-scale variant

TINY_OVERRIDES (environment, JSON) is merged on top, e.g. TINY_OVERRIDES='{"target": {"seconds": 60}}'.
The device run (one H200, 600 s limit) and the local smoke run use the same code; SMOKE only overrides sizes and
time budgets. Times are wall-clock seconds of the training loops (schedules are functions of elapsed time).
"""
import copy
import json
import os

SEED = 1234

BASE = {
    "seed": SEED,
    # ---- corpus (corpus.py) ----
    "corpus": {
        "heldout_per_10000": 200,        # 2% of files, by a hash of "<package>/<path in package>"
        "max_file_bytes": 400_000,       # bigger files are mostly generated tables
        "min_file_bytes": 200,           # empty __init__.py and stubs carry nothing
        "long_line": 300,                # a file with > 5% of its characters in lines longer than this is skipped
        "long_line_frac": 0.05,
        "max_total_bytes": 200_000_000,  # cap (files taken in hash order): ~65M tokens, about what 235 s trains
        "skip_dir_names": ["__pycache__", "site-packages", "dist-packages", "data", "testdata", "test_data"],
    },
    # ---- tokenizer (train_tokenizer.py) ----
    "tokenizer": {
        "vocab_size": 8192,
        "train_bytes": 40_000_000,       # sample of the train split the BPE trainer sees
        "min_frequency": 2,
        "chat_frac": 0.06,               # extra train documents in the chat format (signature -> function), by bytes
        "chat_min_lines": 3, "chat_max_lines": 60,
        "heldout_ci_bytes": 120_000,     # held-out files shipped for CI (permissive licences only)
        "heldout_ci_file_bytes": [1_500, 30_000],
        "heldout_prompts": 24,
    },
    # ---- target (train_target.py): transformers LagunaForCausalLM, every Laguna feature at small scale ----
    "target": {
        "model": dict(
            vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
            num_attention_heads=6, num_key_value_heads=2, head_dim=32,
            num_attention_heads_per_layer=[6, 8, 8, 8] * 2,
            layer_types=(["full_attention"] + ["sliding_attention"] * 3) * 2,
            mlp_layer_types=["dense"] + ["sparse"] * 7,
            sliding_window=256, moe_intermediate_size=128, shared_expert_intermediate_size=256,
            num_experts=16, num_experts_per_tok=4, moe_routed_scaling_factor=2.5, gating="per-head",
            rms_norm_eps=1e-6, max_position_embeddings=4096, attention_bias=False, hidden_act="silu",
            bos_token_id=2, eos_token_id=[2, 24], pad_token_id=9, tie_word_embeddings=False,
            initializer_range=0.02, router_aux_loss_coef=0.0,
            rope_parameters={
                # partial-rotary YaRN on full layers: trained at 512, stretched x8 to max_position_embeddings
                "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                   "original_max_position_embeddings": 512, "beta_fast": 64.0, "beta_slow": 1.0,
                                   "attention_factor": 1.2079441541679836, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
            }),
        "seq_len": 512,
        "batch": 64,
        "seconds": 250,                  # the training loop; startup, eval and saving come on top
        "lr": 3e-3, "min_lr_frac": 0.05, "warmup_steps": 150,
        "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0,
        "bias_update": 1e-3,             # aux-loss-free balancing: correction bias += u * sign(mean load - load)
        "eval_every_s": 20, "eval_batches": 8,
        "experts_impl": ["grouped_mm", "eager"],   # timed at startup on the GPU; the fastest that works wins
    },
    # ---- drafter (train_drafter.py): the Laguna DFlash architecture of dev/dflash_ref.py ----
    "drafter": {
        "model": dict(
            architectures=["DFlashLagunaForCausalLM"], model_type="laguna", vocab_size=8192, draft_vocab_size=8192,
            hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, hidden_act="silu", attention_bias=False,
            layer_types=["sliding_attention"] * 3, sliding_window=256, rms_norm_eps=1e-6, gating="per-head",
            max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            bos_token_id=2, eos_token_id=[2, 24], pad_token_id=9, tie_word_embeddings=False,
            dflash_config={"block_size": 16, "mask_token_id": 12, "num_target_layers": 8,
                           "target_layer_ids": [1, 4, 7], "causal": True}),
        # data (see train_drafter.py): code prompts cut like eval.py's from the train split's files, the target's
        # greedy continuations, and its taps of every position, kept on the device
        "prompts_per_file": 12, "gen_max_prompts": 65536,
        "gen_prompt_min": 80, "gen_prompt_max": 320,   # tokens incl. BOS (eval's held-out prompts: 94..294)
        "gen_new": 144,                  # eval generates 128; + B-1 so that the last anchors have every label
        "gen_seconds": 90,               # generation stops here (or earlier, to leave min_train_seconds)
        "gen_batch": 16384,              # prompts per generation batch (one length: cut to the batch's shortest);
                                         # a decode step costs about the same at any batch size (launch-bound)
        "gen_val": 512,                  # held-out prompts (val split, generated in the same batches): the metric
        "tap_chunk": 256,                # rows per target pass when capturing taps
        "batch": 128,                    # sequences per step
        "anchors": 32,                   # blocks per sequence, among the continuation positions
        "seconds": 300,                  # training loop (at most; the run's deadline usually ends it first)
        "min_train_seconds": 150,
        "loss_gamma": 7.0,               # slot o weighs exp(-(o-1)/gamma) (DFlash paper)
        "lr": 2e-3, "min_lr_frac": 0.05, "warmup_steps": 100,
        "betas": [0.9, 0.95], "weight_decay": 0.01, "grad_clip": 1.0,
        "eval_every_s": 25,
        "eval_n": 128, "eval_rows": 32,  # the loop's tau over eval_n tokens, eval_rows sequences at a time
    },
}

SMOKE = {
    "corpus": {"max_total_bytes": 5_000_000},
    "tokenizer": {"train_bytes": 2_000_000, "vocab_size": 2048, "heldout_prompts": 4, "heldout_ci_bytes": 40_000},
    # a narrower model of the same shape (8 layers, 1 full : 3 sliding, dense first, MoE) so the CPU learns something
    "target": {"model": dict(vocab_size=2048, hidden_size=96, head_dim=16, num_attention_heads=4,
                             num_attention_heads_per_layer=[4, 6, 6, 6] * 2, intermediate_size=256,
                             moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=8,
                             num_experts_per_tok=2, sliding_window=64), "batch": 8, "seq_len": 256, "seconds": 20, "warmup_steps": 10,
               "eval_every_s": 8, "eval_batches": 2, "experts_impl": ["eager"]},
    "drafter": {"model": dict(vocab_size=2048, draft_vocab_size=2048, hidden_size=96, head_dim=16,
                              num_attention_heads=4, intermediate_size=192, sliding_window=64),
                "prompts_per_file": 2, "gen_max_prompts": 256, "gen_prompt_min": 16, "gen_prompt_max": 128,
                "gen_new": 40, "gen_seconds": 20, "gen_batch": 64, "gen_val": 16, "tap_chunk": 16,
                "batch": 8, "anchors": 8, "seconds": 20, "min_train_seconds": 10, "warmup_steps": 10,
                "eval_every_s": 8, "eval_n": 24, "eval_rows": 8},
}


def _merge(a, b):
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            _merge(a[k], v)
        else:
            a[k] = v
    return a


def get(smoke=False):
    c = copy.deepcopy(BASE)
    if smoke:
        _merge(c, copy.deepcopy(SMOKE))
    if os.environ.get("TINY_OVERRIDES"):       # e.g. TINY_OVERRIDES='{"target": {"seconds": 60}}'
        _merge(c, json.loads(os.environ["TINY_OVERRIDES"]))
    c["smoke"] = bool(smoke)
    return c


def stage_args(training=False):
    """The command line every stage takes: WORK [--smoke], plus --deadline and --amp for the training stages."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--smoke", action="store_true")
    if training:
        ap.add_argument("--deadline", type=float, default=0.0, help="unix time by which this script must have exited")
        ap.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"])
    return ap.parse_args()

#!/usr/bin/env python3
"""Train the tiny model's tokenizer, build the chat-format examples, and encode the corpus.

    python3 dev/tiny/train_tokenizer.py WORK [--smoke]

The tokenizer is Laguna's pipeline (the 70 added tokens at ids 0..69, the newline / Qwen2 / ByteLevel
pre-tokenizer chain, ByteLevel decoder, TemplateProcessing that prepends 〈|EOS|〉) with a BPE vocabulary trained
on a sample of the train split; the pipeline pieces are imported from test/make_tokenizer.py. Ids are laid out
like the real file: added tokens 0..69, the 256 byte symbols 70..325, merge results from 326.

Chat-format documents: for a sample of the functions in the train split, the v8 chat template rendered with the
function's signature as the user message and the whole function as the assistant's answer, so that
`./laguna tiny.bin "def quicksort(arr):"` (chat mode) answers with code.

Writes WORK/tok/{tokenizer.json, tokenizer_config.json, chat_template.jinja}, WORK/tok/train.npy and val.npy
(uint16 token streams, every document starts with 〈|EOS|〉 = 2), WORK/tok/stats.json and WORK/heldout.json
(held-out files with permissive licences, their token ids and code prompts cut from them, for CI).
"""
import hashlib
import json
import os
import random
import re
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "test"))
import config  # noqa: E402
from make_tokenizer import laguna_tokenizer_config, train_laguna_bpe  # noqa: E402

TEMPLATE = os.path.join(ROOT, "test", "data", "tokenizer", "chat_template.jinja")
BOS = 2


def train_tokenizer(texts, vocab_size, min_frequency):
    """Laguna's pipeline and id layout (test/make_tokenizer.py), trained on the corpus sample."""
    return train_laguna_bpe(texts, vocab_size, min_frequency)


def tokenizer_config(names):
    return laguna_tokenizer_config(names, 4096)


DEF_RE = re.compile(r"^( *)(?:async )?def \w+\(.*\)(?: -> [^:]+)?:\s*$")


def code_prompts(text):
    """The code prompts of a file, as the held-out set cuts them (and the drafter's training data, like them):
    [(line index, text)] for every def line with at least 4 lines above it; the text is up to 16 lines ending
    with that def line, without a final newline (the model writes the body)."""
    lines = text.split("\n")
    return [(i, "\n".join(lines[max(0, i - 15):i + 1])) for i, l in enumerate(lines)
            if i >= 4 and "def " in l and DEF_RE.match(l)]


def functions(text, min_lines, max_lines):
    """(signature, function source) of the top-level and nested functions with a one-line signature."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        if "def " not in line:
            continue
        m = DEF_RE.match(line)
        if not m:
            continue
        ind = len(m.group(1))
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip(" ")) > ind):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():
            j -= 1
        if not (min_lines <= j - i <= max_lines):
            continue
        body = [l[ind:] if l[:ind].strip() == "" else l for l in lines[i:j]]
        out.append((body[0].rstrip(), "\n".join(body)))
    return out


FALLBACK_FRAME = ("〈|EOS|〉<system>You are a helpful, conversationally-fluent assistant made by Poolside. You are here "
                  "to be helpful to users through natural language conversations.</system>\n<user>",
                  "</user>\n<assistant></think>", "</assistant>\n")


def chat_frame(tok_dir):
    """The v8 template rendered around sentinel strings: (prefix, middle, suffix) for user / assistant text.
    Rendered with transformers' apply_chat_template; the known rendering if that is unavailable (no jinja2)."""
    try:
        return _chat_frame(tok_dir)
    except Exception as e:                      # noqa: BLE001
        print(f"chat template not rendered ({type(e).__name__}: {e}); using the known v8 frame")
        return FALLBACK_FRAME


def _chat_frame(tok_dir):
    from transformers import PreTrainedTokenizerFast
    with open(TEMPLATE, encoding="utf-8") as f:
        tpl = f.read()
    t = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"), chat_template=tpl)
    U, A = "\u2063USER\u2063", "\u2063ASSISTANT\u2063"
    s = t.apply_chat_template([{"role": "user", "content": U}, {"role": "assistant", "content": A}], tokenize=False)
    pre, rest = s.split(U)
    mid, suf = rest.split(A)
    return pre, mid, suf


def encode_stream(tok, texts, bos_flags, chunk=2000):
    parts = []
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)     # no offsets: faster
    for k in range(0, len(texts), chunk):
        encs = enc(texts[k:k + chunk], add_special_tokens=False)
        for e, b in zip(encs, bos_flags[k:k + chunk]):
            if b:
                parts.append(np.array([BOS], dtype=np.uint16))
            parts.append(np.asarray(e.ids, dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def heldout_set(tok, val, packages, tc, rng):
    """Held-out files with permissive licences (text, ids, licence) and code prompts cut from them."""
    lo, hi = tc["heldout_ci_file_bytes"]
    cand = [d for d in val if packages.get(d["pkg"], {}).get("permissive") and lo <= len(d["text"].encode()) <= hi]
    cand.sort(key=lambda d: hashlib.sha1(d["key"].encode()).hexdigest())
    files, total = [], 0
    for d in cand:
        n = len(d["text"].encode())
        if total + n > tc["heldout_ci_bytes"]:
            continue
        p = packages[d["pkg"]]
        files.append({"key": d["key"], "package": d["pkg"], "version": p["version"], "licence": p["licence"],
                      "text": d["text"],
                      "ids": " ".join(map(str, tok.encode(d["text"], add_special_tokens=False).ids))})
        total += n
    # prompts: up to 16 lines of context ending with a def line (no newline: the model writes the body)
    per_file = []
    for fi, f in enumerate(files):
        spots = code_prompts(f["text"])
        rng.shuffle(spots)
        per_file.append([(fi, i, text) for i, text in spots])
    prompts = []
    while len(prompts) < tc["heldout_prompts"] and any(per_file):
        for lst in per_file:
            if lst and len(prompts) < tc["heldout_prompts"]:
                fi, line, text = lst.pop()
                prompts.append({"file": files[fi]["key"], "line": line + 1, "text": text})
    return {"what": "held-out split of the tiny Laguna's corpus (never trained on): files with permissive "
                    "licences, their token ids (space-separated, no BOS) and code prompts cut from them",
            "files": files, "prompts": prompts}


def main():
    a = config.stage_args(training=False)
    C = config.get(a.smoke)
    tc = C["tokenizer"]
    t0 = time.time()
    rng = random.Random(C["seed"])
    train, val = [], []
    with open(os.path.join(a.work, "corpus", "docs.jsonl"), encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            (val if d["split"] == "val" else train).append(d)
    with open(os.path.join(a.work, "corpus", "manifest.json"), encoding="utf-8") as f:
        packages = json.load(f)["packages"]
    train.sort(key=lambda d: d["key"])
    rng.shuffle(train)
    # 1) tokenizer, on a sample of the train split
    sample, n = [], 0
    for d in train:
        if n >= tc["train_bytes"]:
            break
        sample.append(d["text"])
        n += len(d["text"])
    tok, names = train_tokenizer(sample, tc["vocab_size"], tc["min_frequency"])
    out = os.path.join(a.work, "tok")
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"), pretty=False)
    j = json.load(open(os.path.join(out, "tokenizer.json"), encoding="utf-8"))
    assert [x["id"] for x in j["added_tokens"]] == list(range(70)) and len(j["model"]["vocab"]) == tc["vocab_size"]
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(names), f, ensure_ascii=False, indent=2)
    with open(TEMPLATE, encoding="utf-8") as f, open(os.path.join(out, "chat_template.jinja"), "w",
                                                      encoding="utf-8") as g:
        g.write(f.read())
    t1 = time.time()
    print(f"tokenizer: {tc['vocab_size']} ids trained on {n / 1e6:.1f} MB in {t1 - t0:.1f} s")

    # 2) chat-format documents from functions of the train split
    pre, mid, suf = chat_frame(out)
    train_bytes = sum(len(d["text"]) for d in train)
    funcs = []
    for d in train:
        funcs.extend(functions(d["text"], tc["chat_min_lines"], tc["chat_max_lines"]))
    rng.shuffle(funcs)
    chats, nb = [], 0
    for sig, src in funcs:
        if nb >= tc["chat_frac"] * train_bytes:
            break
        chats.append(pre + sig + mid + src + suf)
        nb += len(chats[-1])
    print(f"chat: {len(chats)} of {len(funcs)} functions as chat documents ({nb / 1e6:.1f} MB); "
          f"frame {pre + 'SIG' + mid + 'CODE' + suf!r}")

    # 3) encode: train documents and chat documents interleaved at random; each starts with BOS
    docs = [(d["text"], True) for d in train] + [(c, False) for c in chats]   # chat text already starts with BOS
    rng.shuffle(docs)
    tr = encode_stream(tok, [x for x, _ in docs], [b for _, b in docs])
    va = encode_stream(tok, [d["text"] for d in val], [True] * len(val))
    np.save(os.path.join(out, "train.npy"), tr)
    np.save(os.path.join(out, "val.npy"), va)
    stats = {"vocab_size": tc["vocab_size"], "tokenizer_train_bytes": n, "train_docs": len(train),
             "chat_docs": len(chats), "val_docs": len(val), "train_tokens": int(tr.size), "val_tokens": int(va.size),
             "bytes_per_token_train": round((train_bytes + nb) / max(1, tr.size), 3)}
    with open(os.path.join(out, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    # 4) the held-out set for CI
    ho = heldout_set(tok, val, packages, tc, random.Random(C["seed"] + 1))
    with open(os.path.join(a.work, "heldout.json"), "w", encoding="utf-8") as f:
        json.dump(ho, f, ensure_ascii=False, indent=1)
    print(f"encoded: train {tr.size / 1e6:.2f}M tokens, val {va.size / 1e6:.3f}M tokens "
          f"({stats['bytes_per_token_train']} bytes/token) in {time.time() - t1:.1f} s; heldout.json "
          f"{len(ho['files'])} files, {sum(len(x['text']) for x in ho['files']) / 1e3:.0f} KB, "
          f"{len(ho['prompts'])} prompts; total {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()

"""End to end through ./laguna: prompts built from the chat template and -m chat's multi-turn KV-cache reuse,
against jinja2 (the template) and HF tokenizers (the ids)."""
import json
import os

import pytest
from tokenizers import Tokenizer

from conftest import FIXTURES, run

import export

HF = os.path.join(FIXTURES, "xs21_bf16", "hf")


def render(messages, thinking=False):
    """jinja2 with transformers' chat-template setup (test_tokenizer.py checks that setup against transformers)."""
    with open(os.path.join(HF, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return export._tok_render_fn(HF, config)(messages, True, thinking)


@pytest.fixture(scope="module")
def hf_tok():
    return Tokenizer.from_file(os.path.join(HF, "tokenizer.json"))


def greedy_ids(laguna, model, ids, n):
    return run([laguna, model, "--ids", " ".join(map(str, ids)), "-t", "0", "-n", str(n), "-q"]).stdout.split()


def test_prompt_through_the_template(laguna, exported, hf_tok):
    """`./laguna M "prompt"` generates exactly what the template-rendered, HF-tokenized prompt generates."""
    m = exported("xs21_bf16")
    for system, think in ((None, False), ("Answer in one line.", False), (None, True)):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "def f(x):"}]
        ids = hf_tok.encode(render(msgs, think), add_special_tokens=False).ids
        want = greedy_ids(laguna, m, ids, 10)
        # the text path, printing ids: -m chat --ids (one turn)
        extra = (["-y", system] if system else []) + (["--think"] if think else [])
        r = run([laguna, m, "-m", "chat", "--ids", "-t", "0", "-n", "10", "-q", *extra], input="def f(x):\n")
        got = r.stdout.split("\n")[0].split()
        assert got == want, (system, think)


def test_chat_reuses_the_cache_correctly(laguna, exported, hf_tok):
    """Turn 2 of -m chat (KV cache kept from turn 1) equals a fresh greedy run over the whole conversation
    rendered by jinja2 and tokenized by HF."""
    m = exported("xs21_bf16")
    turns = ["hello there", "now write a loop in C", "and in Python?"]
    r = run([laguna, m, "-m", "chat", "--ids", "-t", "0", "-n", "12", "-q"], input="\n".join(turns) + "\n")
    replies = [line.split() for line in r.stdout.split("\n")[:len(turns)]]
    assert len(replies) == len(turns) and all(replies)
    msgs = []
    for turn, reply in zip(turns, replies):
        msgs.append({"role": "user", "content": turn})
        ids = hf_tok.encode(render(msgs), add_special_tokens=False).ids
        assert greedy_ids(laguna, m, ids, 12)[: len(reply)] == reply
        body = [int(x) for x in reply if int(x) not in (2, 24)]
        msgs.append({"role": "assistant", "content": hf_tok.decode(body, skip_special_tokens=False)})


def test_plain_and_raw_prompts_print_the_same_text(laguna, exported, hf_tok):
    """The default path (template) and --raw (BOS + text) print the decoded greedy continuation."""
    m = exported("xs21_bf16")
    for raw in (False, True):
        text = "class Stack:\n    def push(self, x):"
        ids = [2] + hf_tok.encode(text, add_special_tokens=False).ids if raw else \
            hf_tok.encode(render([{"role": "user", "content": text}]), add_special_tokens=False).ids
        want = [int(x) for x in greedy_ids(laguna, m, ids, 10)]
        out = run([laguna, m, text, "-t", "0", "-n", "10", "-q"] + (["--raw"] if raw else [])).stdout
        assert out == hf_tok.decode(want, skip_special_tokens=False) + "\n"


def test_chat_takes_a_line_longer_than_any_buffer(laguna, exported, hf_tok):
    """A user line of 66,000 bytes (past 64 KiB, a 2-byte character across that boundary) is one turn: the reply
    equals a fresh greedy run over the HF-tokenized rendering."""
    m = exported("xs21_bf16")
    line = " " * 65535 + "é" + "x = 1 " * 77          # ~2,100 tokens: the spaces merge
    r = run([laguna, m, "-m", "chat", "--ids", "-t", "0", "-n", "4", "-q"], input=line + "\nhi\n")
    replies = [x.split() for x in r.stdout.split("\n") if x.strip()]
    ids = hf_tok.encode(render([{"role": "user", "content": line}]), add_special_tokens=False).ids
    assert len(replies) == 2 and replies[0] == greedy_ids(laguna, m, ids, 4)[: len(replies[0])]

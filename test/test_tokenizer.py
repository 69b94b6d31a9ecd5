"""Tokenizer tests: tokenizer.c against Hugging Face `tokenizers` and jinja2, on the synthetic Laguna-style
tokenizer in test/data/tokenizer (built by test/make_tokenizer.py).

  python3 -m pytest -q test/test_tokenizer.py          (add -s to see the counts)

The C side is driven through test/tokenizer_harness.c, compiled here with -Wall -Wextra -Werror into a temp dir.
"""
import json
import os
import random
import shutil
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "test", "data", "tokenizer")
sys.path.insert(0, ROOT)

tokenizers = pytest.importorskip("tokenizers")
import export  # noqa: E402  (only tokenizer_blob and its _tok_ helpers are used)

ADDED_TEXT = ["〈|EOS|〉", "〈|UNK|〉", "<think>", "</think>", "<assistant>", "</assistant>", "<tool_call>",
              "</tool_call>", "〈|SPECIAL_8|〉", "〈|PAD|〉", "〈|FIM_MIDDLE|〉"]


# ---------------------------------------------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="module")
def build(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    exe = str(d / "harness")
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-O2", "-g", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", ROOT,
           os.path.join(ROOT, "test", "tokenizer_harness.c"), os.path.join(ROOT, "tokenizer.c"), "-o", exe]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"build failed:\n{' '.join(cmd)}\n{r.stderr}"
    return d, exe


def write_blob(d, name, hf_dir):
    blob = export.tokenizer_blob(hf_dir)
    path = os.path.join(str(d), name)
    with open(path, "wb") as f:
        f.write(blob)
    return path


@pytest.fixture(scope="module")
def v8(build):
    d, exe = build
    return Harness(exe, write_blob(d, "v8.bin", DATA))


@pytest.fixture(scope="module")
def v2(build):
    # a second checkpoint: the same tokenizer.json, the XS.2-style template embedded in tokenizer_config.json
    d, exe = build
    ck = d / "v2ckpt"
    ck.mkdir()
    shutil.copy(os.path.join(DATA, "tokenizer.json"), ck / "tokenizer.json")
    shutil.copy(os.path.join(DATA, "v2", "tokenizer_config.json"), ck / "tokenizer_config.json")
    return Harness(exe, write_blob(d, "v2.bin", str(ck)), hf_dir=str(ck))


@pytest.fixture(scope="module")
def hf():
    return tokenizers.Tokenizer.from_file(os.path.join(DATA, "tokenizer.json"))


class Harness:
    def __init__(self, exe, blob, hf_dir=DATA):
        self.exe, self.blob, self.hf_dir = exe, blob, hf_dir

    def run(self, cmd, payload):
        path = self.blob + "." + cmd + ".cases"
        with open(path, "wb") as f:
            f.write(payload)
        r = subprocess.run([self.exe, self.blob, cmd, path], capture_output=True)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        return r.stdout.decode().splitlines()

    def encode_bytes(self, items):
        out = self.run("encode", b"".join(struct.pack("<I", len(b)) + b for b in items))
        assert len(out) == len(items)
        return [line if line.startswith("ERR") else [int(x) for x in line.split()] for line in out]

    def encode(self, texts):
        return self.encode_bytes([t.encode("utf-8") for t in texts])

    def pieces(self, texts):
        items = [t.encode("utf-8") for t in texts]
        out = self.run("pieces", b"".join(struct.pack("<I", len(b)) + b for b in items))
        return [[b[int(x.split(":")[0]):int(x.split(":")[1])] for x in line.split()] for b, line in zip(items, out)]

    def decode(self, seqs):
        payload = b"".join(struct.pack("<I", len(s)) + struct.pack(f"<{len(s)}i", *s) for s in seqs)
        out = self.run("decode", payload)
        assert "STREAM MISMATCH" not in out, "streaming decode differs from whole-sequence decode"
        return [bytes.fromhex(line) for line in out]

    def chat(self, convs):
        def s(x):
            if x is None:
                return struct.pack("<I", 0xFFFFFFFF)
            b = x.encode("utf-8")
            return struct.pack("<I", len(b)) + b
        payload = b""
        for msgs, gen, think in convs:
            payload += struct.pack("<III", len(msgs), int(gen), int(think))
            for m in msgs:
                payload += s(m["role"]) + s(m.get("content")) + s(m.get("reasoning_content"))
        out = self.run("chat", payload)
        return [line if line.startswith("ERR") else bytes.fromhex(line).decode("utf-8") for line in out]


U2B = {u: b for b, u in export._tok_bytes_to_unicode().items()}


def check_pieces(h, hf, texts, label):
    """The pre-tokenizer's pieces must match too: with a small vocab many different splits give the same ids."""
    texts = [t for t in texts if not any(a in t for a in ADDED_TEXT + ["〈|SPECIAL_", "〈|RES"])]
    got = h.pieces(texts)
    want = [[bytes(U2B[ch] for ch in p) for p, _ in hf.pre_tokenizer.pre_tokenize_str(t)] for t in texts]
    bad = [(t, w, g) for t, w, g in zip(texts, want, got) if w != g]
    print(f"{label}: {len(texts)} strings, {sum(len(w) for w in want)} pieces, {len(bad)} piece mismatches")
    for t, w, g in bad[:5]:
        i = next((k for k, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
        print(f"  MISMATCH in {t[:200]!r} at piece {i}:\n    HF {w[max(0, i - 2):i + 3]}\n    C  {g[max(0, i - 2):i + 3]}")
    assert not bad


def check_parity(h, hf, texts, label):
    got = h.encode(texts)
    want = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    bad = [(t, w, g) for t, w, g in zip(texts, want, got) if w != g]
    print(f"\n{label}: {len(texts)} strings, {sum(len(w) for w in want)} tokens, {len(bad)} mismatches")
    for t, w, g in bad[:5]:
        i = next((k for k, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
        print(f"  MISMATCH in {t[:200]!r} at token {i}:\n    HF {w[max(0, i - 3):i + 5]}\n    C  {g[max(0, i - 3):i + 5]}")
    assert not bad
    return got


# ---------------------------------------------------------------------------------------------------------------
# encoding

# the spec's vocabulary-independent pre-tokenizer vectors (ByteLevel strings)
SPEC_VECTORS = [
    ("f(x):\r\n\n  y\rz\n", "f|(x|):|čĊĊ|Ġ|Ġy|č|z|Ċ"),
    ("x  \n y", "x|ĠĠ|Ċ|Ġy"),
    ("  \n\n  x", "ĠĠ|ĊĊ|Ġ|Ġx"),
    ("x.\n\ny", "x|.|ĊĊ|y"),
    ("</system>\n<user>Hi", "</|system|>|Ċ|<user|>Hi"),
    ("a\r\nb\r\n\r\nc", "a|čĊ|b|čĊčĊ|c"),
    ("a\rb", "a|č|b"),
    ("12345 don't", "1|2|3|4|5|Ġdon|'t"),
    ("DON'T we'll", "DON|'T|Ġwe|'ll"),
    ("x'ſ", "x|'Å¿"),
    ("  indented\n    code()\n", "Ġ|Ġindented|Ċ|ĠĠĠ|Ġcode|()|Ċ"),
    ("a\tb\t\tc", "a|ĉb|ĉ|ĉc"),
    ("foo \u00a0bar", "foo|Ġ|Âłbar"),
    ("emoji 🦙🦙 ok", "emoji|ĠðŁ¦ĻðŁ¦Ļ|Ġok"),
    ("日本語テキスト", "æĹ¥æľ¬èªŀãĥĨãĤŃãĤ¹ãĥĪ"),
    ("3.14 ²³", "3|.|1|4|Ġ|Â²|Â³"),
]


def test_spec_pretokenizer_vectors(v8, hf):
    # the synthetic file really has Laguna's pre-tokenizer ...
    for text, want in SPEC_VECTORS:
        assert "|".join(p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)) == want, text
    # ... and C agrees with it on these
    check_parity(v8, hf, [t for t, _ in SPEC_VECTORS], "spec vectors")
    check_pieces(v8, hf, [t for t, _ in SPEC_VECTORS], "spec vectors")


NAMED = {
    "python": "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\n"
              "print([fib(i) for i in range(10)])  # 0 1 1 2 3\n",
    "c": "#include <stdio.h>\nint main(void) {\n\tint x = 0x1F;\n\tprintf(\"%d\\n\", x >> 2);\n\treturn 0;\n}\n",
    "js": "const f = async (a, b) => { await fetch(`/api/${a}?b=${b}`); return a ?? b; };\n",
    "rust": "fn main() { let v: Vec<u64> = (1..=10).map(|x| x*x).collect(); println!(\"{:?}\", v); }",
    "go": "func (s *Server) Handle(w http.ResponseWriter, r *http.Request) {\n\tif err != nil {\n\t\treturn\n\t}\n}",
    "sql_html_json": "SELECT a.id FROM t a WHERE a.x>=10;\n<div class=\"x\">&nbsp;</div>\n{\"k\": [1, 2.5e-3, null]}",
    "crlf": "line one\r\nline two\r\n\r\n\r\n  indented\r\n\tlast\r\n",
    "lone_cr": "a\rb\r\rc\r \rd\r\n\re\n\r",
    "mixed_newlines": "\n\n\r\n\n\r\r\n\n \n\t\n",
    "blank_runs": "x\n\n\n\n\ny\n \n \n\nz    \n\n\n   w",
    "tabs": "\tindent\n\t\tmore\t\t\ttabs\t \t x\t",
    "nbsp_ideographic": "a\u00a0b \u00a0c\u3000d\u3000\u3000e \u3000 f\u2028g\u2029h\u0085i\u202fj",
    "other_digits": "Ⅻ ½ ² ٣ ٤٥ ০১ ๑๒ ¼kg 3²=9 Ⅳth ⑦ 𝟘𝟙",
    "contractions": "I'm you're he's we've they'll she'd it't I'M YOU'RE HE'S WE'VE THEY'LL SHE'D IT'T 'Re 'lL 'ſ ''s",
    "cjk": "机器学习是人工智能的一个分支。東京は日本の首都です。한국어 텍스트입니다。",
    "arabic_hebrew": "مرحبا بالعالم، هذا اختبار. ١٢٣ שלום עולם",
    "emoji": "👍🏽👋🏿 👨‍👩‍👧‍👦 🇫🇷🇩🇪 ❤️‍🔥 🦙 ok👌🏻!",
    "combining": "e\u0301 n\u0303o a\u0308\u0304 Z\u0351\u0352\u0353 \u0301x x\u0301\u0301 क्षि",
    "added_literal": "x〈|EOS|〉y<think>a</think>b<assistant>c</assistant>〈|EOS|〉〈|EOS|〉<think><think>",
    "added_partial": "<think <think/> 〈|EOS| 〈|EOS|〉> </assistant <|EOS|> 〈| |〉 〈|SPECIAL_99|〉",
    "empty": "",
    "single_space": " ",
    "only_newlines": "\n\n\n",
    "long_word": "a" * 3000 + " " + "ab" * 1500 + " " + "🦙" * 500,
    "long_space": " " * 1000 + "x" + "\t" * 500,
    "controls": "\x00a\x01\x7f\x1c\x1d b\x0b\x0cc",
}


def test_parity_named(v8, hf):
    check_parity(v8, hf, list(NAMED.values()), "named cases")
    check_pieces(v8, hf, list(NAMED.values()), "named cases")


def source_texts():
    """real code: a handful of stdlib files whole (not the first ones, which were the training text)"""
    lib = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(lib) if n.endswith(".py"))[-12:]
    texts = [open(os.path.join(lib, n), encoding="utf-8", errors="replace").read() for n in names]
    return texts + [open(os.path.join(ROOT, "tokenizer.c"), encoding="utf-8").read()]


def test_parity_source_files(v8, hf):
    texts = source_texts()
    check_parity(v8, hf, texts, "source files")
    check_pieces(v8, hf, texts, "source files")


def random_strings(n, seed, added=True):
    rng = random.Random(seed)
    pools = [
        [chr(c) for c in range(32, 127)] * 3,
        list(" \t\n\r\u00a0\u3000\u2028\u0085\u000b\u000c\u1680\u2009\u202f\u205f\u001c\u200b\ufeff"),
        list("0123456789٣٤۵०১๑Ⅻ½²³⑦𝟙¼"),
        list("aZéßſǅДжΩωאבعربية中文日本語한국ไทยअक्षि"),
        [chr(c) for c in range(0x300, 0x370)] + ["\u200d", "\ufe0f", "\U0001F3FB", "\U0001F3FF"],
        ["👍", "👨", "🦙", "🇫", "🇷", "❤", "😀", "\U0001F9D1"],
        ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'ſ", "'", "''"],
        (ADDED_TEXT if added else []) + ["〈|", "|〉", "<think", "think>", "</", "〈", "〉", "<|EOS|>"],
    ]
    out = []
    for _ in range(n):
        k = rng.randrange(0, 40)
        parts = []
        for _ in range(k):
            r = rng.random()
            if r < 0.04:   # any codepoint at all (unassigned and private use included; no surrogates)
                c = rng.randrange(0x110000 - 0x800)
                parts.append(chr(c + 0x800 if c >= 0xD800 else c))
            else:
                parts.append(rng.choice(rng.choice(pools)))
        out.append("".join(parts))
    return out


FUZZ_N = 5000


def test_fuzz_sweep(v8, hf):
    texts = random_strings(FUZZ_N, seed=1234)
    check_parity(v8, hf, texts, "fuzz sweep (seed 1234)")
    check_pieces(v8, hf, random_strings(FUZZ_N, seed=4321, added=False), "fuzz sweep (seed 4321)")


def test_every_codepoint_class(v8, hf):
    # codepoints in a context where letter / number / whitespace / other all split differently ("xc" joins a
    # letter, "ca" joins anything but a number, "!c" joins only "other"): catches any disagreement between our
    # Unicode tables and HF's Oniguruma. Every codepoint below U+32400 and in U+E0000..U+E01EF (all assigned
    # ones), every 97th elsewhere (unassigned or private use: class 0 on both sides).
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and
           (c < 0x32400 or 0xE0000 <= c <= 0xE01EF or c % 97 == 0)]
    texts = ["".join(f"x{chr(c)}a!{chr(c)}" for c in cps[i:i + 4000]) for i in range(0, len(cps), 4000)]
    check_parity(v8, hf, texts, f"{len(cps)} codepoints")
    check_pieces(v8, hf, texts, f"{len(cps)} codepoints")


def test_single_word_sees_every_codepoint_as_hf(build, tmp_path):
    """An added token with single_word matches only where no word character (\\w) touches it: the codepoints of
    test_every_codepoint_class right before and right after such a token, against HF tokenizers."""
    d, exe = build
    tok = {"id": 4096, "content": "<M>", "single_word": True, "lstrip": False, "rstrip": False, "normalized": False,
           "special": True}
    hf_dir = variant(tmp_path, "single_word", lambda j: j["added_tokens"].append(tok))
    h = Harness(exe, write_blob(d, "single_word.bin", str(hf_dir)), hf_dir=str(hf_dir))
    want = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and
           (c < 0x32400 or 0xE0000 <= c <= 0xE01EF or c % 97 == 0)]
    texts = ["".join(f" {chr(c)}<M> <M>{chr(c)} " for c in cps[i:i + 2000]) for i in range(0, len(cps), 2000)]
    got = check_parity(h, want, texts, f"single_word beside {len(cps)} codepoints")
    n = sum(ids.count(4096) for ids in got)
    assert 0 < n < 2 * len(cps)      # the token matches beside some codepoints and not beside others


def test_invalid_utf8_is_an_error(v8):
    bad = [b"\xff", b"abc\x80", b"\xc3", b"\xc3(", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
           b"ok \xe2\x82", b"\xf8\x88\x80\x80\x80"]
    for b, out in zip(bad, v8.encode_bytes(bad)):
        assert isinstance(out, str) and out.startswith("ERR") and "invalid UTF-8" in out, (b, out)
    ok = v8.encode_bytes([b"\xe2\x82\xac \xf0\x9f\xa6\x99"])
    assert isinstance(ok[0], list)


def test_added_token_passes(build, tmp_path):
    # HF matches added tokens in two passes: normalized=false ones first, then normalized=true ones in the gaps
    # (each leftmost-longest). Build a variant with overlapping tokens of both kinds.
    d, exe = build
    hf0 = tokenizers.Tokenizer.from_file(os.path.join(DATA, "tokenizer.json"))
    hf0.add_tokens([tokenizers.AddedToken("think>x", normalized=True), tokenizers.AddedToken("ab", normalized=False),
                    tokenizers.AddedToken("abc", normalized=True), tokenizers.AddedToken("bcd", normalized=False),
                    tokenizers.AddedToken("〈|EOS|〉〈|EOS|〉", normalized=False)])
    ck = tmp_path / "ck"
    ck.mkdir()
    hf0.save(str(ck / "tokenizer.json"))
    h = Harness(exe, write_blob(d, "passes.bin", str(ck)), hf_dir=str(ck))
    texts = ["<think>x", "think>x", "abc", "abcd", "xabcab", "aabcdd", "〈|EOS|〉〈|EOS|〉〈|EOS|〉", "abthink>xabc"]
    check_parity(h, hf0, texts + random_strings(300, seed=7), "added-token passes")


# ---------------------------------------------------------------------------------------------------------------
# decoding

def test_roundtrip(v8):
    texts = list(NAMED.values()) + random_strings(1000, seed=99)
    ids = v8.encode(texts)
    back = v8.decode(ids)
    bad = [t for t, b in zip(texts, back) if b != t.encode("utf-8")]
    print(f"\nroundtrip: {len(texts)} strings, {len(bad)} differ")
    assert not bad, bad[:3]


def test_decode_matches_hf(v8, hf):
    # random id sequences, including ones that cut UTF-8 characters apart (HF replaces those with U+FFFD)
    rng = random.Random(5)
    n_vocab = hf.get_vocab_size()
    seqs = [[rng.randrange(n_vocab) for _ in range(rng.randrange(0, 12))] for _ in range(1000)]
    seqs += [[rng.choice(range(70, 326)) for _ in range(rng.randrange(1, 8))] for _ in range(1000)]  # raw bytes
    seqs.append([n_vocab + 5, 2, -1])   # unknown ids decode to nothing
    got = v8.decode(seqs)
    want = [hf.decode([i for i in s if 0 <= i < n_vocab], skip_special_tokens=False) for s in seqs]
    bad = [(s, w, g) for s, w, g in zip(seqs, want, got) if g != w.encode("utf-8")]
    print(f"\ndecode: {len(seqs)} sequences, {len(bad)} mismatches")
    assert not bad, bad[:3]


# ---------------------------------------------------------------------------------------------------------------
# chat

def msg(role, content, reasoning=None):
    m = {"role": role, "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


CODE = "def add(a, b):\n    return a + b\n"
CONVERSATIONS = [
    [msg("user", "Hello")],
    [msg("user", "Write a function that adds two numbers.\n")],
    [msg("system", "You are a terse coding assistant."), msg("user", "Hi")],
    [msg("system", "Custom system with trailing space   \n"), msg("user", "x")],
    [msg("system", ""), msg("user", "Hi")],
    [msg("system", "   \n"), msg("user", "Hi")],
    [msg("user", "Write add."), msg("assistant", CODE, "The user wants add()."), msg("user", "Now subtract.")],
    [msg("user", "a?"), msg("assistant", "b."), msg("user", "c?"), msg("assistant", "d.", "reason d"),
     msg("user", "e?")],
    [msg("system", "Be brief."), msg("user", "1"), msg("assistant", "2", "  padded reasoning \n"),
     msg("user", "3"), msg("assistant", "  padded answer\n\n"), msg("user", "4")],
    [msg("user", "ünïcödé 日本語 🦙\r\n\ttabs"), msg("assistant", "〈|EOS|〉 literal <think> in text", "")],
    [msg("user", "q"), msg("assistant", "a")],
    [msg("user", "q"), msg("assistant", ""), msg("user", "again")],
    [msg("user", "q"), msg("assistant", " \n", "only reasoning"), msg("user", "again")],
    [msg("user", "q"), msg("system", "a later system message"), msg("user", "r")],
]


def jinja_renderer(hf_dir):
    """export.py's jinja2 rendering of hf_dir's chat template: render(messages, add_generation_prompt, thinking)"""
    with open(os.path.join(hf_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        return export._tok_render_fn(hf_dir, json.load(f))


@pytest.mark.parametrize("which", ["v8", "v2"])
def test_chat_matches_jinja(which, request):
    h = request.getfixturevalue(which)
    convs = [(m, gen, think) for m in CONVERSATIONS for gen in (True, False) for think in (False, True)]
    got = h.chat(convs)
    render = jinja_renderer(h.hf_dir)
    n = 0
    for (msgs, gen, think), g in zip(convs, got):
        want = render(msgs, gen, think)
        assert g == want, f"{which} gen={gen} think={think} {msgs}\n jinja2: {want!r}\n C:      {g!r}"
        n += 1
    print(f"\nchat {which}: {n} renderings byte-identical to jinja2")


CHAT_PIECES = ["", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "x", "Hello", "def f():\n    pass\n",
               "〈|EOS|〉", "<think>", "</think>", "<assistant>", "</user>", "ünïcödé", "日本語", "🦙", "{{ x }}", "{% if %}",
               "'\"", "\\n", "</system>", "<tool_call>"]


def random_conversations(n, seed):
    """n random (messages, add_generation_prompt, enable_thinking): an optional system message first, then user /
    assistant / later system turns in any order, contents and reasoning from CHAT_PIECES (empty, whitespace-only,
    padded, special-token text), reasoning absent / empty / present, content None now and then"""
    rng = random.Random(seed)

    def text():
        return "".join(rng.choice(CHAT_PIECES) for _ in range(rng.randrange(0, 5)))

    out = []
    for _ in range(n):
        msgs = []
        if rng.random() < 0.5:
            msgs.append(msg("system", text()))
        for _ in range(rng.randrange(0, 6)):
            role = rng.choice(["user", "user", "assistant", "assistant", "system"])
            if role == "assistant":
                r = rng.random()
                m = msg(role, None if rng.random() < 0.1 else text(), None if r < 0.4 else "" if r < 0.5 else text())
            else:
                m = msg(role, text())
            msgs.append(m)
        out.append((msgs, rng.random() < 0.5, rng.random() < 0.5))
    return out


@pytest.mark.parametrize("which", ["v8", "v2"])
def test_chat_random_conversations_match_jinja(which, request, hf):
    """2,000 random conversations per template, rendered by tokenizer.c and by jinja2 (transformers' environment):
    byte-identical, or both refuse (jinja2 raises where C returns an error); the renderings then encode to HF's ids"""
    h = request.getfixturevalue(which)
    convs = random_conversations(2000, seed=7 if which == "v8" else 8)
    got = h.chat(convs)
    render = jinja_renderer(h.hf_dir)
    both_refuse = 0
    for (msgs, gen, think), g in zip(convs, got):
        try:
            want = render(msgs, gen, think)
        except Exception as e:      # the template cannot render it: C must refuse it too
            assert g.startswith("ERR"), f"{which} gen={gen} think={think} {msgs}\n jinja2 raised {e!r}\n C: {g!r}"
            both_refuse += 1
            continue
        assert g == want, f"{which} gen={gen} think={think} {msgs}\n jinja2: {want!r}\n C:      {g!r}"
    print(f"\nchat {which}: {len(convs)} random conversations, {len(convs) - both_refuse} byte-identical to jinja2, "
          f"{both_refuse} refused by both")
    check_parity(h, hf, [g for g in got if not g.startswith("ERR")], f"chat {which} renderings encoded")


def test_chat_template_as_named_list(tmp_path):
    """tokenizer_config.json's chat_template may be a list of named templates: the "default" one is used, as
    transformers' apply_chat_template does, so the export equals the plain-string form."""
    v2 = os.path.join(DATA, "v2", "tokenizer_config.json")
    config = json.load(open(v2, encoding="utf-8"))
    named = dict(config, chat_template=[{"name": "tool_use", "template": "{{ not the default"},
                                        {"name": "default", "template": config["chat_template"]}])
    blobs = []
    for name, cfg in (("plain", config), ("named", named)):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(os.path.join(DATA, "tokenizer.json"), d / "tokenizer.json")
        (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
        blobs.append(export.tokenizer_blob(str(d)))
    assert blobs[0] == blobs[1]


def test_jinja_setup_matches_transformers():
    # export.py renders templates like transformers' apply_chat_template; check that on both templates
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except Exception:
        pytest.skip("transformers not installed")
    for d, src in ((DATA, os.path.join(DATA, "chat_template.jinja")), (DATA, os.path.join(DATA, "v2", "chat_template.jinja"))):
        with open(src, encoding="utf-8") as f:
            template = f.read()
        render = export._tok_jinja_env().from_string(template)
        for msgs in CONVERSATIONS:
            for gen in (True, False):
                for think in (False, True):
                    want = render_jinja_template([msgs], chat_template=template, add_generation_prompt=gen,
                                                 enable_thinking=think)[0][0]
                    got = render.render(messages=msgs, tools=None, documents=None, add_generation_prompt=gen,
                                        enable_thinking=think)
                    assert got == want, (src, msgs, gen, think)


DEFAULT = ("You are a helpful, conversationally-fluent assistant made by Poolside. You are here to be helpful to "
           "users through natural language conversations.")


def test_chat_published_format(v8, v2):
    # our templates follow the published renderings (spec §2) for a single user turn "Hello"
    hello = [msg("user", "Hello")]
    v8_off, v8_on, v2_off, v2_on = v8.chat([(hello, True, False), (hello, True, True)]) + \
        v2.chat([(hello, True, False), (hello, True, True)])
    assert v8_off == f"〈|EOS|〉<system>{DEFAULT}</system>\n<user>Hello</user>\n<assistant></think>"
    assert v8_on == f"〈|EOS|〉<system>{DEFAULT}</system>\n<user>Hello</user>\n<assistant><think>"
    assert v2_off == f"〈|EOS|〉<system>\n\n{DEFAULT}\n</system>\n<user>\nHello\n</user>\n<assistant>\n</think>"
    assert v2_on == f"〈|EOS|〉<system>\n\n{DEFAULT}\n</system>\n<user>\nHello\n</user>\n<assistant>\n<think>"
    # the empty system message: v8 drops the block unless thinking is on
    empty = [msg("system", ""), msg("user", "Hi")]
    off, on = v8.chat([(empty, True, False), (empty, True, True)])
    assert off == "〈|EOS|〉<user>Hi</user>\n<assistant></think>"
    assert on == "〈|EOS|〉<system></system>\n<user>Hi</user>\n<assistant><think>"


def test_chat_errors(v8):
    out = v8.chat([([msg("tool", "x")], True, False)])
    assert out[0].startswith("ERR") and "role" in out[0]


def test_chat_prompt_encoding(v8, hf):
    # the rendered prompt starts with 〈|EOS|〉 (id 2) and needs no extra BOS
    text = v8.chat([([msg("user", "Tell me the capital of Italy.")], True, True)])[0]
    ids = check_parity(v8, hf, [text], "rendered prompt")[0]
    assert ids[0] == 2 and ids[-2:] == [23, 18] and ids.count(2) == 1


# ---------------------------------------------------------------------------------------------------------------
# export

def run_export(hf_dir):
    code = f"import sys; sys.path.insert(0, {ROOT!r}); import export; b = export.tokenizer_blob({str(hf_dir)!r}); " \
           "print('NONE' if b is None else len(b))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def variant(tmp_path, name, edit):
    j = json.load(open(os.path.join(DATA, "tokenizer.json"), encoding="utf-8"))
    edit(j)
    d = tmp_path / name
    d.mkdir()
    with open(d / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)
    return d


REFUSALS = {
    "normalizer": (lambda j: j.update(normalizer={"type": "NFC"}), "normalizer"),
    "pretokenizer": (lambda j: j.update(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False,
                                                       "trim_offsets": True, "use_regex": True}), "pre_tokenizer"),
    "regex": (lambda j: j["pre_tokenizer"]["pretokenizers"][1]["pattern"].update(
        Regex=j["pre_tokenizer"]["pretokenizers"][1]["pattern"]["Regex"].replace("\\p{N}|", "\\p{N}{1,3}|")),
        "pre-tokenizer step"),
    "model": (lambda j: j["model"].update(type="WordPiece"), "model type"),
    "decoder": (lambda j: j.update(decoder={"type": "Metaspace"}), "decoder"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_export_refuses(tmp_path, name):
    edit, needle = REFUSALS[name]
    r = run_export(variant(tmp_path, name, edit))
    assert r.returncode != 0, r.stdout
    assert "unsupported tokenizer" in r.stderr and needle in r.stderr and "HINT" in r.stderr, r.stderr


def _drop_from_vocab(j, contents, renumber):
    """delete added tokens' entries from model.vocab (closing the gaps: the vocabulary's ids stay 0..n-1);
    renumber: give the added tokens the ids HF tokenizers computes for them (next free ids past the vocabulary)"""
    v = j["model"]["vocab"]
    for c in contents:
        v.pop(c)
    for new_id, tok in enumerate(sorted(v, key=v.get)):
        v[tok] = new_id
    top = None
    for a in sorted(j["added_tokens"], key=lambda a: a["id"]):
        if a["content"] in v:
            a["id"] = v[a["content"]]
        elif renumber:
            a["id"] = top + 1 if top is not None and top >= len(v) else len(v)
        top = a["id"] if top is None else max(top, a["id"])


ADDED_ID_CASES = {   # tokenizer.json edits: export must refuse exactly those where HF gives an added token another id
    "consistent": lambda j: None,
    "swapped": lambda j: [a.update(id={18: 9, 9: 18}[a["id"]]) for a in j["added_tokens"] if a["id"] in (9, 18)],
    "missing_from_vocab": lambda j: _drop_from_vocab(j, ["〈|EOS|〉"], renumber=False),
    "missing_renumbered": lambda j: _drop_from_vocab(j, ["〈|EOS|〉", "<think>"], renumber=True),
}


@pytest.mark.parametrize("name", sorted(ADDED_ID_CASES))
def test_export_added_token_ids_as_hf_assigns_them(tmp_path, name):
    """tokenizer.c takes each added token's "id"; HF tokenizers assigns its own (the vocabulary's id, or the next
    free one). Export accepts a file exactly when the two agree for every added token."""
    d = variant(tmp_path, name, ADDED_ID_CASES[name])
    j = json.load(open(d / "tokenizer.json", encoding="utf-8"))
    tk = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    agree = all(tk.token_to_id(a["content"]) == a["id"] for a in j["added_tokens"])
    r = run_export(d)
    assert (r.returncode == 0) == agree, (name, agree, r.stderr)
    if not agree:
        assert "HF tokenizers would give it id" in r.stderr, r.stderr
    assert name in ("consistent", "missing_renumbered") or not agree   # the edits do what they say


def flag_variant(tmp_path, name, edit_json, edit_decoder):
    """a checkpoint directory: DATA's tokenizer.json and tokenizer_config.json, edited"""
    d = variant(tmp_path, name, edit_json)
    cfg = json.load(open(os.path.join(DATA, "tokenizer_config.json"), encoding="utf-8"))
    edit_decoder(cfg["added_tokens_decoder"])
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    return d


CONFIG_REFUSALS = {   # tokenizer_config.json's added_tokens_decoder, edited: (edit, words in the message)
    "bad_key": (lambda dec: dec.update({"x": dec["18"]}), ["'x'", "not a token id"]),
}


@pytest.mark.parametrize("name", sorted(CONFIG_REFUSALS))
def test_export_refuses_added_tokens_it_cannot_reproduce(tmp_path, name):
    edit, words = CONFIG_REFUSALS[name]
    r = run_export(flag_variant(tmp_path, name, lambda j: None, edit))
    assert r.returncode != 0 and "tokenizer_config.json" in r.stderr and "HINT" in r.stderr, r.stderr
    assert all(w in r.stderr for w in words), r.stderr


def test_config_only_added_tokens_get_the_ids_transformers_gives(build, tmp_path):
    """added_tokens_decoder entries tokenizer.json does not have: transformers adds them by ascending key, at the
    content's vocabulary id or else the next free id past the vocabulary, whatever the key says; an entry whose key
    names another token's id is a new token too. tokenizer.c encodes and decodes them as transformers does."""
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer
    d, exe = build
    vocab = json.load(open(os.path.join(DATA, "tokenizer.json"), encoding="utf-8"))["model"]["vocab"]
    inv = {i: t for t, i in vocab.items()}
    base = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": True}

    def edit(dec):
        dec["5000"] = dict(base, content="<A>")
        dec["4500"] = dict(base, content="<B>", rstrip=True)
        dec["3000"] = dict(base, content=inv[1000])           # a vocabulary token under another id's key
        dec["18"] = dict(base, content="<thought>")           # replaces nothing: "<think>" keeps id 18
    hf_dir = flag_variant(tmp_path, "config_only", lambda j: None, edit)
    notes = []
    blob = export.tokenizer_blob(str(hf_dir), say=notes.append)
    path = os.path.join(str(d), "config_only.bin")
    with open(path, "wb") as f:
        f.write(blob)
    h = Harness(exe, path, hf_dir=str(hf_dir))
    tf = AutoTokenizer.from_pretrained(str(hf_dir))
    assert tf.convert_tokens_to_ids(["<thought>", "<B>", "<A>"]) == [4096, 4097, 4098]   # keys 18 < 4500 < 5000
    assert sum("gets id" in n for n in notes) == 4, notes
    texts = [f"x<A>y<B>  z{inv[1000]}w<thought><think>", "<A><A> <B>\n<B>", inv[1000] * 3] + \
        random_strings(300, seed=81)
    assert h.encode(texts) == [tf(t, add_special_tokens=False)["input_ids"] for t in texts]
    seqs = [[4096, 4097, 4098, 18, 1000, 157]]
    assert [b.decode() for b in h.decode(seqs)] == [tf.decode(s) for s in seqs]


def test_added_token_flags_match_transformers(build, tmp_path):
    """Added tokens' lstrip / rstrip / normalized / single_word, set at random in tokenizer.json and in
    tokenizer_config.json's added_tokens_decoder (which transformers puts over the json's), plus entries only the
    config has (vocabulary tokens, which transformers adds as added tokens) and added tokens that are whitespace
    themselves (which a neighbour's strip can swallow): tokenizer.c encodes as transformers' AutoTokenizer does, on
    text full of added tokens, words and whitespace (where HF itself panics, "AddedVocabulary bad split", there is
    nothing to compare)."""
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer
    d, exe = build
    rng = random.Random(2024)
    vocab = json.load(open(os.path.join(DATA, "tokenizer.json"), encoding="utf-8"))["model"]["vocab"]
    pieces = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if 400 <= i < 4096 and len(t) >= 3]
    spaces = [" ", "  ", "\t", "\n", "\n\n", "\u3000", "\u00a0", "\r\n", "\t\t"]
    texts = []
    for k in range(1500):
        pool = ADDED_TEXT + spaces + spaces + ["x", "def", "ab c", "日本", "'s", "_", "é", "\u0301", "٣", "!"]
        texts.append("".join(rng.choice(pool) for _ in range(rng.randrange(1, 16))))
    texts += random_strings(500, seed=79)
    changed = panics = 0
    for trial in range(6):
        def edit_json(j):
            for a in j["added_tokens"]:
                for f in ("lstrip", "rstrip", "normalized", "single_word"):
                    if rng.random() < 0.3:
                        a[f] = not a[f]
            if trial % 2:                                         # whitespace tokens, at the next free ids
                for k, ws in enumerate(["\t\t", "  "]):
                    j["added_tokens"].append({"id": 4096 + k, "content": ws, "single_word": False,
                                              "lstrip": rng.random() < 0.5, "rstrip": rng.random() < 0.5,
                                              "normalized": rng.random() < 0.5, "special": True})

        def edit_decoder(dec):
            for a in dec.values():
                for f in ("lstrip", "rstrip", "normalized", "single_word"):
                    if rng.random() < 0.3:
                        a[f] = not a[f]
            for t in rng.sample(pieces, 3):                       # vocabulary tokens only the config adds
                dec[str(vocab[t])] = {"content": t, "lstrip": rng.random() < 0.5, "rstrip": rng.random() < 0.5,
                                      "normalized": False, "single_word": False, "special": False}
                texts.append(f"a{t}b {t}  {t}\n")
        hf_dir = flag_variant(tmp_path, f"flags{trial}", edit_json, edit_decoder)
        h = Harness(exe, write_blob(d, f"flags{trial}.bin", str(hf_dir)), hf_dir=str(hf_dir))
        tf = AutoTokenizer.from_pretrained(str(hf_dir))
        got = h.encode(texts)
        want = []
        for t in texts:
            try:
                want.append(tf(t, add_special_tokens=False)["input_ids"])
            except BaseException:                                 # pyo3's PanicException
                want.append(None)
        plain = [e.ids for e in tokenizers.Tokenizer.from_file(os.path.join(DATA, "tokenizer.json")).encode_batch(
            texts, add_special_tokens=False)]
        bad = [(t, w, g) for t, w, g in zip(texts, want, got) if w is not None and w != g]
        changed += sum(w is not None and w != p for w, p in zip(want, plain))
        panics += sum(w is None for w in want)
        print(f"flags trial {trial}: {len(texts)} texts, {sum(len(w or []) for w in want)} tokens, {len(bad)} "
              f"mismatches, {sum(w is None for w in want)} where HF panics")
        for t, w, g in bad[:3]:
            print(f"  {t!r}\n    transformers {w}\n    C            {g}")
        assert not bad
    assert changed > 1000 and panics < 100   # the flags change the ids: the case tests something


def test_ignore_merges_matches_hf(build, hf, tmp_path):
    """BPE ignore_merges (HF tokenizers): a piece that is a vocabulary token as a whole becomes that token, whatever
    the merges would make of it. The vocabulary gets 3,000 pieces the merges split (code and random text) as
    tokens of their own, with no merges that reach them; tokenizer.c must then encode as HF does with the flag on,
    and as HF does with it off."""
    d, exe = build
    texts = source_texts() + random_strings(3000, seed=77)
    split = {}                       # piece -> how often, for pieces BPE makes two or more tokens of
    for t in texts:
        for p, _ in hf.pre_tokenizer.pre_tokenize_str(t):
            if len(hf.model.tokenize(p)) > 1:
                split[p] = split.get(p, 0) + 1
    new = sorted(split, key=lambda p: (-split[p], p))[:3000]
    encodings = {}
    for flag in (True, False):
        def edit(j):
            v = j["model"]["vocab"]
            for k, p in enumerate(new):
                v[p] = 4096 + k
            j["model"]["ignore_merges"] = flag
        hf_dir = variant(tmp_path, f"ignore_merges_{flag}", edit)
        h = Harness(exe, write_blob(d, f"ignore_merges_{flag}.bin", str(hf_dir)), hf_dir=str(hf_dir))
        want = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        encodings[flag] = check_parity(h, want, texts, f"ignore_merges={flag}, {len(new)} whole pieces added")
    changed = sum(a != b for a, b in zip(encodings[True], encodings[False]))
    print(f"the flag changes the ids of {changed} of {len(texts)} texts")
    assert changed > len(texts) // 4     # the case above tests something


def test_byte_fallback_changes_nothing(tmp_path, hf):
    """byte_fallback only names <0xXX> tokens for characters the vocabulary lacks; after ByteLevel every character
    is a byte token in the vocabulary. HF encodes alike with it on, and export writes the same blob."""
    d = variant(tmp_path, "byte_fallback", lambda j: j["model"].update(byte_fallback=True))
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(DATA, f), d / f)
    assert export.tokenizer_blob(str(d)) == export.tokenizer_blob(DATA)
    on = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    texts = random_strings(2000, seed=78) + source_texts()
    assert [e.ids for e in on.encode_batch(texts, add_special_tokens=False)] == \
           [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]


def test_truncation_and_padding_are_not_applied(tmp_path, hf):
    """transformers encodes without tokenizer.json's truncation and padding unless a call asks for them (HF
    tokenizers' own encode applies them): export notes them and writes the same blob as without them."""
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

    def edit(j):
        j["truncation"] = {"direction": "Right", "max_length": 5, "strategy": "LongestFirst", "stride": 0}
        j["padding"] = {"strategy": {"Fixed": 12}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 9,
                        "pad_type_id": 0, "pad_token": "〈|PAD|〉"}
    d = variant(tmp_path, "truncation", edit)
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(DATA, f), d / f)
    notes = []
    assert export.tokenizer_blob(str(d), say=notes.append) == export.tokenizer_blob(DATA, say=lambda *a: None)
    assert any("truncation" in n for n in notes) and any("padding" in n for n in notes), notes
    tf = AutoTokenizer.from_pretrained(str(d))
    texts = random_strings(300, seed=80) + source_texts()[:2]
    assert [tf(t, add_special_tokens=False)["input_ids"] for t in texts] == \
           [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]


def test_blob_version_1_still_read(build, v8):
    """models/tiny.bin holds a version 1 tokenizer blob (version 2 without n_whole): it encodes the same."""
    d, exe = build
    with open(v8.blob, "rb") as f:
        blob = f.read()
    assert struct.unpack_from("<I", blob, 4)[0] == 2 and struct.unpack_from("<I", blob, 24)[0] == 0   # n_whole 0
    old = blob[:4] + struct.pack("<I", 1) + blob[8:24] + blob[28:]
    path = os.path.join(str(d), "v1.bin")
    with open(path, "wb") as f:
        f.write(old)
    texts = random_strings(500, seed=5)
    assert Harness(exe, path).encode(texts) == v8.encode(texts)
    bad = blob[:4] + struct.pack("<I", 3) + blob[8:]
    with open(path, "wb") as f:
        f.write(bad)
    r = subprocess.run([exe, path, "encode", path], capture_output=True, text=True)
    assert r.returncode != 0 and "version 3" in r.stdout + r.stderr and "HINT" in r.stdout + r.stderr


def test_export_merges_formats_and_missing(tmp_path):
    # merges spelled "a b" (older tokenizers) give the same blob as ["a", "b"]
    d = variant(tmp_path, "oldmerges", lambda j: j["model"].update(merges=[" ".join(m) for m in j["model"]["merges"]]))
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(DATA, f), d / f)
    assert export.tokenizer_blob(str(d)) == export.tokenizer_blob(DATA)
    assert run_export(tmp_path).stdout.strip() == "NONE"   # no tokenizer.json: no blob


# ---------------------------------------------------------------------------------------------------------------
# memory

def test_valgrind_clean(v8, v2):
    if not shutil.which("valgrind"):
        pytest.skip("valgrind not installed")
    texts = list(NAMED.values())[:-4] + random_strings(200, seed=3)
    for h, cmd, payload in [
        (v8, "encode", b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)
         + struct.pack("<I", 3) + b"a\xffb"),
        (v8, "decode", b"".join(struct.pack("<I", 4) + struct.pack("<4i", i, i + 7, 2, 99999) for i in range(0, 4096, 50))),
        (v2, "chat", None),
    ]:
        path = h.blob + ".vg"
        if payload is None:   # a few conversations
            payload = b""
            for msgs in CONVERSATIONS[:6]:
                payload += struct.pack("<III", len(msgs), 1, 1)
                for m in msgs:
                    for x in (m["role"], m["content"], m.get("reasoning_content")):
                        payload += struct.pack("<I", 0xFFFFFFFF) if x is None else \
                            struct.pack("<I", len(x.encode())) + x.encode()
        with open(path, "wb") as f:
            f.write(payload)
        r = subprocess.run(["valgrind", "--error-exitcode=9", "--leak-check=full", "--errors-for-leak-kinds=all",
                            "-q", h.exe, h.blob, cmd, path], capture_output=True, text=True)
        assert r.returncode == 0, f"valgrind ({cmd}):\n{r.stderr[-3000:]}"

#!/usr/bin/env python3
"""Build the synthetic Laguna-style tokenizer used by the tokenizer tests.

The real Laguna tokenizer.json is not downloadable here, so we build a small one (4096 ids) with the Hugging Face
`tokenizers` library and exactly Laguna's pipeline (../shared/spec/tokenizer.md §1, §6):
  - 70 added tokens at ids 0..69 (known names at their known ids, placeholders elsewhere), normalizer null
  - pre-tokenizer Sequence: Split (?:\\r?\\n)+(?!\\r?\\n) MergedWithNext > Split Qwen2 regex Isolated > ByteLevel
  - BPE by merge rank, byte_fallback false, ignore_merges false, no unk; ByteLevel decoder
  - TemplateProcessing post-processor that prepends 〈|EOS|〉 (id 2)
  - ids 70..325 are the 256 byte symbols in GPT-2 bytes_to_unicode order, merge results from 326 up
Training text is offline: Python stdlib sources plus the multilingual / multi-language snippets below.

It also writes two chat templates written for this project from the published *format* (not copied from anywhere):
  test/data/tokenizer/chat_template.jinja      XS-2.1 style (v8): compact
  test/data/tokenizer/v2/chat_template.jinja   XS.2 style (v5/v2): newline padded

usage: python3 test/make_tokenizer.py [outdir]      (default test/data/tokenizer)
The outputs are committed; re-running gives the same files (deterministic corpus and trainer).
"""
import json
import os
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 4096
NEWLINE_RE = r"(?:\r?\n)+(?!\r?\n)"
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def added_token_names():
    """ids 0..69. Known ids from the spec; 4..17 hold names known to exist somewhere in 0..19 (positions guessed)
    and placeholders; 20..22 and 27..69 are 〈|SPECIAL_n|〉 (the names jump from SPECIAL_3 to SPECIAL_8)."""
    names = {0: "〈|UNK|〉", 1: "〈|CODE_START|〉", 2: "〈|EOS|〉", 3: "〈|CODE_END|〉",
             4: "〈|FIM_START|〉", 5: "〈|FIM_MIDDLE|〉", 6: "〈|FIM_SUFFIX|〉", 7: "〈|META_START|〉",
             8: "〈|META_END|〉", 9: "〈|PAD|〉", 10: "〈|CLS|〉", 11: "〈|SEP|〉", 12: "〈|MASK|〉",
             18: "<think>", 19: "</think>", 23: "<assistant>", 24: "</assistant>",
             25: "<tool_call>", 26: "</tool_call>"}
    for i in range(13, 18):
        names[i] = f"〈|RESERVED_{i}|〉"   # ids 13..17: names not published
    for k, i in enumerate([20, 21, 22] + list(range(27, 70))):
        names[i] = f"〈|SPECIAL_{k + 1 if k < 3 else k + 5}|〉"
    return [names[i] for i in range(70)]


NOT_SPECIAL = {18, 19, 23, 25, 26}   # tokenizer_config: only </assistant> (24) of these is special


def bytes_to_unicode():
    """GPT-2's byte -> printable unicode char map, in its canonical order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return list(zip(bs, [chr(c) for c in cs]))


# ---------------------------------------------------------------------------------------------------------------
# training text (written for this project)
MULTILINGUAL = """
The quick brown fox jumps over the lazy dog. It's a test; we'll see what they've done, and I'm sure you'd agree.
DON'T SHOUT. WE'LL WIN. THEY'RE HERE. I'D SAY IT'S FINE.
Le renard brun rapide saute par-dessus le chien paresseux. C'est l'été, n'est-ce pas ? Où est la bibliothèque ?
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Übung, Äpfel und Öl.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la estación? ¡Qué día más bonito, señor!
A rápida raposa marrom pula sobre o cão preguiçoso. Ação, coração, informação, não.
La volpe marrone veloce salta sopra il cane pigro. Perché è così difficile? Città e università.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Это тест токенизатора.
Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο. Καλημέρα κόσμε.
敏捷的棕色狐狸跳过了懒狗。今天天气很好，我们去公园散步吧。机器学习和自然语言处理。
日本語のテキストです。東京は日本の首都です。こんにちは、世界！カタカナとひらがなを混ぜます。
빠른 갈색 여우가 게으른 개를 뛰어넘습니다. 안녕하세요, 세계! 한국어 텍스트입니다.
الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم. اللغة العربية جميلة. ٠١٢٣٤٥٦٧٨٩
השועל החום המהיר קופץ מעל הכלב העצלן. שלום עולם.
तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है। नमस्ते दुनिया। ०१२३४५६७८९
สุนัขจิ้งจอกสีน้ำตาลกระโดดข้ามสุนัขขี้เกียจ สวัสดีชาวโลก
Con cáo nâu nhanh nhẹn nhảy qua con chó lười. Xin chào thế giới. Tiếng Việt có dấu.
Hızlı kahverengi tilki tembel köpeğin üzerinden atlar. Merhaba dünya. İstanbul, ığdır, şişe.
Szybki brązowy lis przeskakuje nad leniwym psem. Zażółć gęślą jaźń.
Emoji: 👍🏽 👋🏿 🦙🦙 🎉 ❤️ 👨‍👩‍👧 🇫🇷 ok. Math: ½ ¼ ² ³ Ⅻ ∑ ∫ √ π ≈ ≤ ≥ ∞ → ←.
Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ　and ideographic　spaces; non\u00a0breaking\u00a0spaces; tabs\tand\tmore\ttabs.
"""

CODE_SNIPPETS = r'''
#include <stdio.h>
#include <stdlib.h>

typedef struct { int n; float *data; } Vec;

static float dot(const Vec *a, const Vec *b) {
    float s = 0.0f;
    for (int i = 0; i < a->n; i++) { s += a->data[i] * b->data[i]; }
    return s;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s FILE\n", argv[0]); return 1; }
    printf("hello, world %d\n", 42);
    return 0;
}

function fetchUser(id) {
  return fetch(`/api/users/${id}`).then((res) => res.json()).catch((err) => console.error(err));
}
const xs = [1, 2, 3].map(x => x * 2).filter(x => x > 2);
export default class Widget extends Component { render() { return <div className="w">{this.props.name}</div>; } }

fn main() {
    let v: Vec<u32> = (0..10).map(|x| x * x).collect();
    println!("{:?}", v);
    match v.get(3) { Some(x) => println!("{}", x), None => {} }
}

package main
import "fmt"
func main() { for i := 0; i < 10; i++ { fmt.Println(i) } }

SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY name LIMIT 10;
<html><body><p class="x">Hello &amp; welcome</p></body></html>
{"key": "value", "list": [1, 2.5, true, null], "nested": {"a": "b"}}
'''


def training_corpus():
    lib = os.path.dirname(os.__file__)
    texts = [MULTILINGUAL * 30, CODE_SNIPPETS.replace("\n", "\r\n") * 5, CODE_SNIPPETS * 20]
    total = 0
    for name in sorted(os.listdir(lib)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(lib, name), encoding="utf-8", errors="replace") as f:
            s = f.read()
        texts.append(s)
        total += len(s)
        if total > 3_000_000:
            break
    # the chat format itself, so its pieces get merges as in the real vocab
    chat = ("〈|EOS|〉<system>You are a helpful assistant.</system>\n<user>Write a function.</user>\n"
            "<assistant><think>Let me think.</think>Here it is.</assistant>\n")
    texts.append(chat * 50)
    return texts


def laguna_pretokenizer():
    """Laguna's three stages: newline runs (merged with next), the Qwen2 regex (isolated), ByteLevel."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(NEWLINE_RE), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(QWEN2_RE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_laguna_bpe(texts, vocab_size, min_frequency=2):
    """A BPE tokenizer with Laguna's pipeline and layout, trained on texts: (tokenizers.Tokenizer, added names).
    (dev/tiny/train_tokenizer.py uses it too.)"""
    names = added_token_names()
    # 1) learn merges with the trainer
    t0 = Tokenizer(models.BPE())
    t0.pre_tokenizer = laguna_pretokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=names, min_frequency=min_frequency,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t0.train_from_iterator(texts, trainer=trainer)
    merges = json.loads(t0.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]

    # 2) lay the vocab out like the real file: added 0..69, bytes 70..325 (GPT-2 order), merge results 326..
    vocab = {n: i for i, n in enumerate(names)}
    for b, ch in bytes_to_unicode():
        vocab[ch] = len(vocab)
    kept = []
    for a, b in merges:
        if len(vocab) >= vocab_size:
            break
        if a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        kept.append((a, b))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=kept, byte_fallback=False, ignore_merges=False))
    tok.add_tokens([AddedToken(n, special=(i not in NOT_SPECIAL), normalized=False, lstrip=False, rstrip=False,
                               single_word=False) for i, n in enumerate(names)])
    tok.normalizer = None
    tok.pre_tokenizer = laguna_pretokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="〈|EOS|〉 $A", pair="〈|EOS|〉 $A $B:1",
                                                       special_tokens=[("〈|EOS|〉", 2)])
    return tok, names


def laguna_tokenizer_config(names, model_max_length):
    """tokenizer_config.json for the added tokens `names` (ids 0..69), as Laguna's checkpoints have it."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "〈|EOS|〉", "eos_token": "〈|EOS|〉", "pad_token": "〈|PAD|〉", "unk_token": "〈|UNK|〉",
        "model_max_length": model_max_length,
        "added_tokens_decoder": {str(i): {"content": n, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": i not in NOT_SPECIAL}
                                 for i, n in enumerate(names)},
    }


def build(outdir):
    byte_map = bytes_to_unicode()
    tok, names = train_laguna_bpe(training_corpus(), VOCAB_SIZE)
    os.makedirs(outdir, exist_ok=True)
    tok.save(os.path.join(outdir, "tokenizer.json"), pretty=False)

    # sanity: the layout we promised
    j = json.load(open(os.path.join(outdir, "tokenizer.json"), encoding="utf-8"))
    assert [a["id"] for a in j["added_tokens"]] == list(range(70)), "added tokens must be ids 0..69"
    assert j["model"]["vocab"][byte_map[0][1]] == 70 and len(j["model"]["vocab"]) == VOCAB_SIZE

    config = laguna_tokenizer_config(names, 1000000000000000019884624838656)
    with open(os.path.join(outdir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    with open(os.path.join(outdir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(TEMPLATE_V8)
    os.makedirs(os.path.join(outdir, "v2"), exist_ok=True)
    with open(os.path.join(outdir, "v2", "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(TEMPLATE_V2)
    # the v2 directory is a second "checkpoint": same tokenizer, template embedded in tokenizer_config.json
    # (the other way checkpoints ship it), so export has to find it there
    with open(os.path.join(outdir, "v2", "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(config, chat_template=TEMPLATE_V2), f, ensure_ascii=False, indent=2)
    print(f"wrote {outdir}: {len(j['model']['vocab'])} ids, {len(j['model']['merges'])} merges")


# ---------------------------------------------------------------------------------------------------------------
# Chat templates, written here from the published output format (spec §2). Everything is emitted through {{ }}
# expressions so the result does not depend on jinja's block-whitespace settings.

# XS-2.1 style (v8): compact. First system message replaces the default and is rstripped; an empty one drops the
# block unless tools or thinking are on. History assistant turns keep their reasoning when thinking is on.
TEMPLATE_V8 = r"""{#- Laguna XS-2.1 style chat template (v8 format), written for laguna's tokenizer tests. -#}
{%- set enable_thinking = enable_thinking | default(false) -%}
{%- set default_system = 'You are a helpful, conversationally-fluent assistant made by Poolside. You are here to be helpful to users through natural language conversations.' -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = (messages[0].content or '').rstrip() -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set system_text = default_system -%}
    {%- set rest = messages -%}
{%- endif -%}
{{- '〈|EOS|〉' -}}
{%- if system_text or tools or enable_thinking -%}
    {{- '<system>' + system_text -}}
    {%- if tools -%}
        {{- '\n\n### Tools\n\nYou may call functions to assist with the user query.\nAll available function signatures are listed below:\n<available_tools>\n' -}}
        {%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}
        {{- '</available_tools>' -}}
    {%- endif -%}
    {{- '</system>\n' -}}
{%- endif -%}
{%- for m in rest -%}
    {%- if m.role == 'system' -%}
        {{- '<system>' + m.content + '</system>\n' -}}
    {%- elif m.role == 'user' -%}
        {{- '<user>' + m.content + '</user>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {{- '<assistant>' -}}
        {%- if enable_thinking -%}
            {{- '<think>' + (m.reasoning_content or '') + '</think>' -}}
        {%- else -%}
            {{- '</think>' -}}
        {%- endif -%}
        {%- generation -%}
        {{- m.content or '' -}}
        {%- for tc in (m.tool_calls or []) -%}
            {%- set f = tc.function if tc.function is defined else tc -%}
            {{- '<tool_call>' + f.name -}}
            {%- for k, v in (f.arguments or {}).items() -%}
                {{- '<arg_key>' + k + '</arg_key><arg_value>' -}}
                {{- v if v is string else v | tojson -}}
                {{- '</arg_value>' -}}
            {%- endfor -%}
            {{- '</tool_call>' -}}
        {%- endfor -%}
        {{- '</assistant>' -}}
        {%- endgeneration -%}
        {{- '\n' -}}
    {%- elif m.role == 'tool' -%}
        {{- '<tool_response>' + m.content + '</tool_response>\n' -}}
    {%- else -%}
        {{- raise_exception('unknown role: ' + m.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<assistant>' + ('<think>' if enable_thinking else '</think>') -}}
{%- endif -%}
"""

# XS.2 style (v5/v2): every block padded with newlines; the system block is always present; assistant content
# and reasoning are trimmed, and an empty answer gets no newline of its own.
TEMPLATE_V2 = r"""{#- Laguna XS.2 style chat template (v5/v2 format), written for laguna's tokenizer tests. -#}
{%- set enable_thinking = enable_thinking | default(false) -%}
{%- set default_system = 'You are a helpful, conversationally-fluent assistant made by Poolside. You are here to be helpful to users through natural language conversations.' -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = messages[0].content or '' -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set system_text = default_system -%}
    {%- set rest = messages -%}
{%- endif -%}
{{- '〈|EOS|〉<system>\n' -}}
{%- if tools -%}
    {{- '### Tools\n\nYou may call functions to assist with the user query.\nAll available function signatures are listed below:\n<available_tools>\n' -}}
    {%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}
    {{- '</available_tools>\n' -}}
{%- endif -%}
{{- '\n' + system_text + '\n</system>\n' -}}
{%- for m in rest -%}
    {%- if m.role == 'system' -%}
        {{- '<system>\n' + m.content + '\n</system>\n' -}}
    {%- elif m.role == 'user' -%}
        {{- '<user>\n' + m.content + '\n</user>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {{- '<assistant>\n' -}}
        {%- if enable_thinking -%}
            {{- '<think>\n' + (m.reasoning_content or '') | trim + '\n</think>\n' -}}
        {%- else -%}
            {{- '</think>\n' -}}
        {%- endif -%}
        {%- set answer = (m.content or '') | trim -%}
        {%- if answer -%}
            {{- answer + '\n' -}}
        {%- endif -%}
        {%- for tc in (m.tool_calls or []) -%}
            {%- set f = tc.function if tc.function is defined else tc -%}
            {{- '<tool_call>' + f.name + '\n' -}}
            {%- for k, v in (f.arguments or {}).items() -%}
                {{- '<arg_key>' + k + '</arg_key>\n<arg_value>' -}}
                {{- v if v is string else v | tojson -}}
                {{- '</arg_value>\n' -}}
            {%- endfor -%}
            {{- '</tool_call>\n' -}}
        {%- endfor -%}
        {{- '</assistant>\n' -}}
    {%- elif m.role == 'tool' -%}
        {{- '<tool_response>\n' + m.content + '\n</tool_response>\n' -}}
    {%- else -%}
        {{- raise_exception('unknown role: ' + m.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<assistant>\n' + ('<think>' if enable_thinking else '</think>') -}}
{%- endif -%}
"""

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    build(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "data", "tokenizer"))

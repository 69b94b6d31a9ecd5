// tokenizer.h -- Laguna's tokenizer in plain C: byte-level BPE behind Laguna's exact pre-tokenizer, streaming
// decoding, and chat prompts built from pieces of the checkpoint's own chat template.
//
// Encoding is identical to Hugging Face `Tokenizer.from_file("tokenizer.json").encode(text,
// add_special_tokens=False).ids` (with the added tokens' flags of tokenizer_config.json, as transformers loads it):
// added tokens (ids 0..69 in Laguna) are matched literally first, with the whitespace beside them where they lstrip /
// rstrip; each span between them is cut before every newline run, then by the Qwen2-style regex, then byte-level BPE
// merges by rank (or, with BPE's ignore_merges, a piece that is a vocabulary token as a whole is that token).
// No BOS is added: a rendered chat prompt already starts with 〈|EOS|〉 (id 2).
//
// Everything comes from the "tokenizer" blob that export.py stores in the model file (format in tokenizer.c).
#ifndef TOKENIZER_H
#define TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

enum { TOK_CHAT_NPREV = 7, TOK_CHAT_NNEXT = 7, TOK_CHAT_NFIELDS = 5 };

typedef struct { const char *s; size_t len; int present; } TokPiece;

typedef struct {
    int n_vocab;              // ids are 0..n_vocab-1
    int bos_id, eos_id;       // from tokenizer_config.json, -1 if unknown (Laguna: both 2, 〈|EOS|〉)
    char *strings;            // one allocation holding every string below
    uint32_t *tok_off;        // [n_vocab] offset into strings of the bytes id i decodes to
    uint32_t *tok_len;        // [n_vocab] their length; UINT32_MAX: no token has this id
    int32_t byte_id[256];     // id of the token for a single byte
    // merges: open-addressing hash (left id, right id) -> (rank, merged id)
    uint64_t *merge_key;      // [merge_cap] left << 32 | right, UINT64_MAX = empty slot
    uint32_t *merge_rank;     // [merge_cap]
    int32_t *merge_id;        // [merge_cap]
    size_t merge_cap;         // power of two
    int n_merges;
    // BPE ignore_merges (0 tokens when off): open-addressing hash, by their bytes, of the ids a whole piece becomes
    int32_t *whole_id;        // [whole_cap] an id, or -1 = empty slot
    size_t whole_cap;         // power of two
    int n_whole;
    // added tokens, matched literally in two passes like HF: first the ones with normalized=false, then the rest
    int n_added;
    int32_t *added_id;        // [n_added]
    uint32_t *added_off, *added_len;  // content in strings
    uint32_t *added_flags;            // 1 special, 2 normalized, 4 lstrip, 8 rstrip (takes the whitespace beside
                                      // it), 16 single_word (no word character beside it)
    int *added_order[2];      // per pass: indices of that pass's added tokens sorted by first byte
    int added_first[2][257];  // per pass: added_order[p][added_first[p][b] .. added_first[p][b+1]) start with b
    // chat format (see export.py, _tok_chat_data)
    int has_chat;
    TokPiece chat[2][TOK_CHAT_NPREV][TOK_CHAT_NNEXT];  // [enable_thinking][previous field][next field]
    TokPiece chat_mid[2];                               // between an assistant turn's reasoning and its content
    int chat_reasoning[2];                              // does the template show reasoning in this mode
    int chat_strip[TOK_CHAT_NFIELDS];                   // 0 none, 1 lstrip, 2 rstrip, 3 strip
    int chat_asst_e[2];                                 // are there pieces for after an empty assistant reply
} Tokenizer;

// Parse the blob (copies what it needs; the blob may be freed afterwards). 0 on success; otherwise -1 and
// err holds a message with a hint.
int tokenizer_init(Tokenizer *t, const unsigned char *blob, uint64_t nbytes, char *err, size_t errsz);
void tokenizer_free(Tokenizer *t);
int tokenizer_vocab_size(const Tokenizer *t);

// Encode len bytes of UTF-8 text. On success returns 0 and *ids (malloc'd, caller frees) holds *n_ids ids.
// Invalid UTF-8 is an error (-1, with the byte offset in err): HF only ever sees valid UTF-8 (Python str / Rust
// &str), so there is no reference behaviour to match for it.
int tokenizer_encode(const Tokenizer *t, const char *text, size_t len, int **ids, int *n_ids, char *err,
                     size_t errsz);

// The pieces BPE sees, for debugging and tests: 2 * *n_pieces byte offsets (start, end) into text, in order,
// added tokens included as pieces of their own. *bounds is malloc'd. Same errors as tokenizer_encode.
int tokenizer_pretokenize(const Tokenizer *t, const char *text, size_t len, size_t **bounds, int *n_pieces,
                          char *err, size_t errsz);

// id of the token whose text is exactly `text` (an added token like "</assistant>", or a vocab entry's
// decoded bytes), -1 if none.
int tokenizer_token_id(const Tokenizer *t, const char *text);
int tokenizer_is_special(const Tokenizer *t, int id);   // an added token marked special (e.g. 〈|EOS|〉, </assistant>)

// Streaming decode: feed ids one at a time while generating. Each call returns the newly completed text
// (NUL-terminated, valid until the next call on this decoder, *len set if len != NULL); an incomplete UTF-8
// character is held back until its last byte arrives. Bytes that can never form a character become U+FFFD,
// exactly like HF's decode (String::from_utf8_lossy). Unknown ids decode to nothing, as in HF.
typedef struct {
    const Tokenizer *t;
    unsigned char pend[4];    // bytes of an incomplete UTF-8 character
    int npend;
    char *buf;                // output of the last call
    size_t cap;
} TokenDecoder;
void tokenizer_decoder_init(TokenDecoder *d, const Tokenizer *t);
const char *tokenizer_decode_next(TokenDecoder *d, int id, size_t *len);
const char *tokenizer_decode_flush(TokenDecoder *d, size_t *len);    // end of stream: what is still held back
void tokenizer_decoder_free(TokenDecoder *d);
// Decode a whole sequence (= HF decode(ids, skip_special_tokens=False)); malloc'd, NUL-terminated.
char *tokenizer_decode(const Tokenizer *t, const int *ids, int n, size_t *len);

// Chat prompts, byte-identical to what the checkpoint's chat_template.jinja renders (export.py checks this).
// role: "system" (only the first message may be an empty system, which removes/empties the system block as the
// template does), "user" or "assistant"; reasoning: an assistant turn's reasoning (NULL or "" for none; shown
// only when enable_thinking and the template shows it). Without a system message the template's default
// system prompt is used. Returns malloc'd NUL-terminated text, or NULL with a message in err (no chat template
// in the model file, an unknown role, or a message order the template does not support).
typedef struct { const char *role; const char *content; const char *reasoning; } ChatMessage;
char *tokenizer_render_chat(const Tokenizer *t, const ChatMessage *msgs, int n, int add_generation_prompt,
                            int enable_thinking, char *err, size_t errsz);

#endif

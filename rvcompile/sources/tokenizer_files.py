"""Synthetic tokenizer files for presets built with random weights.

A preset has no tokenizer of its own, so `--random-weights` builds one that fits its vocabulary:
a byte-level BPE with no merges (every byte of the text becomes one token), Gemma's special
tokens at Gemma's ids, and placeholders for every other id so the vocabulary has exactly
`vocab_size` entries. Ids:

    0 <pad>   1 <eos>   2 <bos>   3 <unk>   105 <start_of_turn>   106 <end_of_turn>
    300..555  the 256 byte-level symbols (byte b is id 300 + b)
    others    <unused_N> with N the id: ordinary (non-special) tokens that encoding never produces

The tokenizer adds no BOS by itself (no post-processor); the chat template writes it.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from rvcompile.model.config import ConfigError, Gemma4Config

SPECIAL_TOKENS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    105: "<start_of_turn>",
    106: "<end_of_turn>",
}
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BYTE_BASE_ID = 300  # byte b is token BYTE_BASE_ID + b
MIN_VOCAB = 1024


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def synthetic_vocab(vocab_size: int) -> dict[str, int]:
    """token -> id for every id in [0, vocab_size)."""
    if vocab_size < MIN_VOCAB:
        raise ConfigError(
            f"synthetic tokenizer: vocab_size {vocab_size} is too small (need >= {MIN_VOCAB} to "
            f"hold the special tokens and the 256 byte symbols at ids {BYTE_BASE_ID}.."
            f"{BYTE_BASE_ID + 255})"
        )
    byte_chars = _bytes_to_unicode()
    names = [f"<unused_{i}>" for i in range(vocab_size)]
    for i, tok in SPECIAL_TOKENS.items():
        names[i] = tok
    for b, ch in byte_chars.items():
        names[BYTE_BASE_ID + b] = ch
    return {tok: i for i, tok in enumerate(names)}


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """The byte-level BPE described in the module docstring, as a `tokenizers.Tokenizer`."""
    vocab = synthetic_vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS[3]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False, single_word=False, lstrip=False,
                   rstrip=False)
        for t in SPECIAL_TOKENS.values()
    ])
    return tok


def synthetic_tokenizer_json(vocab_size: int) -> str:
    """tokenizer.json text for `synthetic_tokenizer(vocab_size)`."""
    return synthetic_tokenizer(vocab_size).to_str()


# Gemma-style turns. A system message gets its own turn; "assistant" is written as "model".
_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}"
    "{%- endif -%}"
)


def default_chat_template() -> str:
    """Jinja chat template: `{{ bos_token }}<start_of_turn>user\\n...<end_of_turn>\\n` per turn
    (roles system, user, assistant -> model), then `<start_of_turn>model\\n` when
    add_generation_prompt is set."""
    return _CHAT_TEMPLATE


def default_generation_config(cfg: Gemma4Config) -> dict[str, Any]:
    """generation_config for the synthetic tokenizer (its BOS/PAD ids, the config's EOS ids)."""
    return {
        "bos_token_id": BOS_ID,
        "eos_token_id": list(cfg.eos_token_ids),
        "pad_token_id": PAD_ID,
    }

"""Tokenizers: a Hugging Face `tokenizer.json` wrapper and a `tiktoken.model` one (Kimi) for real checkpoints, and
a byte-level one for nano models.

All render chats with a Jinja template (the checkpoint's own, else a built-in one per family) and share
`TextStream`, which turns a reply's growing list of ids into its text as it streams.
"""
from __future__ import annotations

import base64
import binascii
import math
import re
import secrets
import time
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

from nano.config import ModelConfig, is_token_id, read_json
from nano.errors import NanoError

# Built-in chat templates, used by nano models and by checkpoints whose tokenizer ships none.
BUILTIN_TEMPLATES = {
    "kimi": (
        "{% for m in messages %}"
        "{% if m.role not in ('system', 'user', 'assistant') %}"
        "{{ raise_exception('unsupported chat role ' ~ m.role) }}{% endif %}"
        "<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    ),
    "glm": (
        "[gMASK]<sop>"
        "{% for m in messages %}"
        "{% if m.role not in ('system', 'user', 'assistant') %}"
        "{{ raise_exception('unsupported chat role ' ~ m.role) }}{% endif %}"
        "<|{{ m.role }}|>\n{{ m.content }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
}
# The special tokens of each family's byte tokenizer (ids follow the 256 byte ids) and which of them end a reply.
# GLM also stops on <|user|> / <|observation|>: the model starting a new turn means its own turn is over.
BYTE_SPECIALS = {
    "kimi": ["[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"],
    "glm": ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
}
BYTE_EOS = {"kimi": ["<|im_end|>", "[EOS]"], "glm": ["<|endoftext|>", "<|user|>", "<|observation|>"]}
BYTE_COUNT = 256


def byte_vocab_size(family: str) -> int:
    """Ids of the byte tokenizer for `family`: the 256 bytes, then its special tokens."""
    return BYTE_COUNT + len(BYTE_SPECIALS[family])


TEMPLATE_SECONDS = 10.0      # the longest a chat template may take to render ...
TEMPLATE_MAX_SIZE = 1 << 25  # ... and the most characters (items of a list, bits of an integer) of anything it builds
_DEADLINE: ContextVar[float] = ContextVar("chat_template_deadline", default=math.inf)


def _bounded(value: Any = None, size: int = 0) -> Any:
    """`value`, once the render is known to be within its time and `value` (or a result of `size`) within its size."""
    if time.monotonic() > _DEADLINE.get():
        raise NanoError(f"chat template: rendering took longer than {TEMPLATE_SECONDS:g} s")
    if max(size, len(value) if isinstance(value, Sized) else 0) > TEMPLATE_MAX_SIZE:
        raise NanoError(f"chat template: a value or the output grew past {TEMPLATE_MAX_SIZE:,} characters or items")
    return value


def _size(value: Any) -> int:
    return value.bit_length() if isinstance(value, int) else len(value) if isinstance(value, Sized) else 0


def _loop_steps(items: Iterable[Any]) -> Iterator[Any]:
    """A template loop's items, each step within the render's time (an empty loop calls nothing else)."""
    for item in items:
        yield _bounded(item)


class _Bounds:
    """Bounds in time and size for Jinja's sandbox (no way into Python's internals), so that a checkpoint's template
    cannot hang nano or fill its memory. Every call, attribute, operator, loop step and output checks the render's
    deadline and what it yields; `*`, `**` and `+` check their result's size before computing it (`'x' * 10**10`).
    ChatTemplate mixes them into the sandbox: jinja2 loads with the first template, not with nano."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        return _bounded(super().call(context, obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return _bounded(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _bounded(super().getitem(obj, argument))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and isinstance(left, int) != isinstance(right, int):   # a sequence repeated
            size = _size(left) * right if isinstance(right, int) else left * _size(right)
        else:
            size = _size(left) * right if operator == "**" and isinstance(right, int) else _size(left) + _size(right)
        _bounded(size=size)
        return _bounded(super().call_binop(context, operator, left, right))


class ChatTemplate:
    """A Jinja chat template compiled in a bounded sandbox, with the helpers Hugging Face templates expect."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError, nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        sandbox = type("BoundedSandbox", (_Bounds, ImmutableSandboxedEnvironment), {})
        env = sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                      optimized=False, finalize=_bounded)   # nothing of the template runs at compile time
        env.globals.update(raise_exception=_raise_template_error,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            tree = env.parse(source)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Call(nodes.ImportedName(f"{__name__}._loop_steps"), [loop.iter], [], None, None)
            self._template = env.from_string(tree)
        except (TemplateError, RecursionError) as err:
            raise NanoError(f"invalid chat template: {err}") from None
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The template's text for `messages`, in at most TEMPLATE_SECONDS and TEMPLATE_MAX_SIZE characters."""
        deadline = _DEADLINE.set(time.monotonic() + TEMPLATE_SECONDS)
        try:
            pieces, length = [], 0
            for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **self._tokens):
                length += len(piece)
                pieces.append(_bounded(piece, length))
            return "".join(pieces)
        except NanoError:
            raise
        except Exception as err:   # whatever the checkpoint's template raises (1 / 0, endless recursion, ...)
            raise NanoError(f"chat template failed: {type(err).__name__}: {err}") from None
        finally:
            _DEADLINE.reset(deadline)


def _raise_template_error(message: str) -> None:
    raise NanoError(f"chat template rejected the conversation: {message}")


def utf8_text(text: str, what: str) -> str:
    """`text` unchanged, or a NanoError if it cannot be encoded as UTF-8: Python keeps bytes that were not UTF-8
    (in a command line, a pipe) as lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise NanoError(f"{what} is not valid UTF-8 text") from None
    return text


def special_pattern(tokens: Iterable[str]) -> re.Pattern[str]:
    """A regex that finds any of `tokens` (the longest of those starting at one place) as its one group, and never
    matches when there are none. Its alternatives are factored by common prefix, as a trie: `re` tries a plain list
    of alternatives one after the other at every position, and 256 special tokens (Kimi) made content of `<|` repeated
    take 5 s per MB; factored, a position fails at its first character that no token continues with."""
    trie: dict[str, dict] = {}
    for token in tokens:
        node = trie
        for char in token:
            node = node.setdefault(char, {})
        node[""] = {}                      # a token ends here

    def alternatives(node: dict[str, dict]) -> str:
        branches = [re.escape(char) + alternatives(child) for char, child in node.items() if char]
        if not branches:
            return ""
        ends = "" in node                  # a shorter token ends here: the longer ones are optional (greedy)
        return (branches[0] if len(branches) == 1 and not ends else f"(?:{'|'.join(branches)})") + "?" * ends

    try:
        return re.compile(f"({alternatives(trie)})" if trie else "(?!)")
    except RecursionError:     # one level per character
        raise NanoError("the tokenizer has a special token too long to search for (hundreds of characters)") from None


class Tokenizer:
    """What the engine needs from a tokenizer; subclasses set the attributes and implement the methods."""

    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    chat_template: ChatTemplate
    special_text: re.Pattern[str]      # finds the text of any special token (`special_pattern`)
    special_token_ids: frozenset[int]  # the control tokens (roles, ends of turns): never part of a reply's text

    def encode(self, text: str, specials: bool = True) -> list[int]:
        """Token ids of `text`, nothing added around it. A special token's text inside it becomes that token's id,
        or with `specials` False is plain text like any other."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included; invalid UTF-8 becomes U+FFFD."""
        raise NotImplementedError

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for (what bits per byte counts). This fallback decodes each token alone, which
        is wrong for a token that holds part of a character; the subclasses know their vocabulary's bytes."""
        return [self.decode([i]).encode() for i in range(self.vocab_size)]

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of the chat prompt, ending where the assistant's reply begins. A message's content is text: a special
        token typed in it (`<|assistant|>`) is encoded as plain text, never as the control token, so content cannot
        forge a turn; the template's own special tokens stay special. The template sees each special token's text
        in the content as a placeholder (it still strips, trims or cuts the content as it would), which then
        becomes that text's plain ids."""
        mark, hidden = f"\ue000{secrets.randbelow(10 ** 18)}:", []   # a mark no content holds (random per call)

        def hide(found: re.Match[str]) -> str:
            hidden.append(found.group())
            return f"{mark}{len(hidden) - 1}\ue001"

        placeheld = [{**m, "content": self.special_text.sub(hide, m["content"])}
                     if isinstance(m.get("content"), str) else m for m in messages]
        rendered = utf8_text(self.render_chat(placeheld, add_generation_prompt=True), "the conversation")
        pieces = re.split(re.escape(mark) + "(\\d+)\ue001", rendered)   # odd pieces: a hidden text's number
        return [i for n, piece in enumerate(pieces)
                for i in (self.encode(hidden[int(piece)], specials=False) if n % 2 else self.encode(piece))]


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are UTF-8 bytes, then the family's special tokens (the nano stand-ins' vocabulary)."""

    def __init__(self, family: str):
        if family not in BYTE_SPECIALS:
            raise NanoError(f"no byte tokenizer for model family {family!r}")
        self.specials = BYTE_SPECIALS[family]
        self.special_ids = {token: BYTE_COUNT + i for i, token in enumerate(self.specials)}
        self.vocab_size = byte_vocab_size(family)
        self.eos_token_ids = [self.special_ids[token] for token in BYTE_EOS[family]]
        self.bos_token_id = None
        self.chat_template = ChatTemplate(BUILTIN_TEMPLATES[family])
        self.special_text = special_pattern(self.specials)
        self.special_token_ids = frozenset(self.special_ids.values())

    def encode(self, text: str, specials: bool = True) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self.special_text.split(text) if specials else [text]):  # odd: special tokens
            ids.extend([self.special_ids[piece]] if i % 2 else piece.encode("utf-8"))
        return ids

    def token_bytes(self) -> list[bytes]:
        return [bytes([i]) for i in range(BYTE_COUNT)] + [token.encode() for token in self.specials]

    def decode(self, ids: list[int]) -> str:
        """Bytes are decoded together (multi-byte characters span ids); ids past the vocabulary decode to ''."""
        text, pending = [], bytearray()
        for i in ids:
            if 0 <= i < BYTE_COUNT:
                pending.append(i)
                continue
            text.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if BYTE_COUNT <= i < self.vocab_size:
                text.append(self.specials[i - BYTE_COUNT])
        text.append(pending.decode("utf-8", errors="replace"))
        return "".join(text)


class HFTokenizer(Tokenizer):
    """A checkpoint's `tokenizer.json` (via the `tokenizers` library) with its chat template."""

    def __init__(self, path: Path, cfg: ModelConfig):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
            self._plain = RustTokenizer.from_file(str(path / "tokenizer.json"))   # reads special tokens as text
        except Exception as err:  # the Rust side raises plain Exception for any unreadable file
            raise NanoError(f"cannot read {path / 'tokenizer.json'}: {err}") from None
        self._plain.encode_special_tokens = True
        special = {i: token.content for i, token in self._tok.get_added_tokens_decoder().items() if token.special}
        self.special_text = special_pattern(special.values())
        self.special_token_ids = frozenset(special)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        settings = read_json(path / "tokenizer_config.json")
        self.bos_token_id = cfg.bos_token_id
        self.eos_token_ids = _eos_token_ids(path, cfg)
        source = _template_source(settings, path) or BUILTIN_TEMPLATES[cfg.family]
        self.chat_template = ChatTemplate(source, _token_text(settings.get("bos_token")),
                                          _token_text(settings.get("eos_token")))

    def encode(self, text: str, specials: bool = True) -> list[int]:
        return (self._tok if specials else self._plain).encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self) -> list[bytes]:
        """A byte-level BPE token may hold part of a character (a rare character is split into its bytes), and
        decoding it alone gives U+FFFD (3 bytes) instead of its 1 or 2: so the bytes come from the vocabulary, the
        token strings mapped back through the byte-level alphabet. Other decoders fall back to decoding each
        token alone."""
        from tokenizers import decoders

        added = {i: token.content.encode() for i, token in self._tok.get_added_tokens_decoder().items()}
        alphabet = byte_level_alphabet() if isinstance(self._tok.decoder, decoders.ByteLevel) else {}
        pieces = []
        for i in range(self.vocab_size):
            piece = self._tok.id_to_token(i) or ""
            if i in added:
                pieces.append(added[i])
            elif alphabet and all(char in alphabet for char in piece):
                pieces.append(bytes(alphabet[char] for char in piece))
            else:
                pieces.append(self.decode([i]).encode())
        return pieces


# Kimi's pre-tokenizer (`TikTokenTokenizer.pat_str` in the checkpoints' tokenization_kimi.py). A run of Han characters
# is one piece; a word is letters and marks other than Han (`&&[^\p{Han}]` is a class intersection, which tiktoken's
# Rust regex engine compiles and Python's `re` does not), with an English contraction attached; digits go in groups
# of up to 3; punctuation keeps one leading space and trailing newlines; whitespace splits as in GPT-4's pattern.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
TIKTOKEN_SPECIALS = 256        # special ids follow the vocabulary: Kimi's are 163584..163839
TIKTOKEN_MAX_CHARS = 400_000   # Kimi encodes long texts in windows of this many characters ...
TIKTOKEN_MAX_RUN = 25_000      # ... and cuts runs of (non-)whitespace longer than this, which tiktoken is slow on


class TiktokenTokenizer(Tokenizer):
    """A Kimi checkpoint's tokenizer: `tiktoken.model` (one `base64(token bytes) rank` line per token; the rank is
    the id and the merge priority) and the special tokens of `tokenizer_config.json`, with Kimi's pre-tokenizer.

    The 256 ids after the vocabulary are special tokens. Those that `added_tokens_decoder` lists take their names from
    it and the others are called `<|reserved_token_{id}|>`, as in Kimi's own tokenization_kimi.py.
    """

    def __init__(self, path: Path, cfg: ModelConfig):
        try:
            import tiktoken
        except ImportError:
            raise NanoError(f"{path / 'tiktoken.model'} needs the tiktoken package: pip install tiktoken") from None
        self._pieces = read_tiktoken_ranks(path / "tiktoken.model")
        config_file = path / "tokenizer_config.json"
        if not config_file.is_file():
            raise NanoError(f"tokenizer_config.json not found in {path} (it names tiktoken.model's special tokens)")
        settings = read_json(config_file)
        self.specials = tiktoken_specials(settings, len(self._pieces), config_file)
        self.special_ids = {token: i for i, token in enumerate(self.specials, start=len(self._pieces))}
        self.special_text = special_pattern(self.specials)
        self.special_token_ids = frozenset(self.special_ids.values())
        self.vocab_size = len(self._pieces) + len(self.specials)
        self._bytes = self._pieces + [token.encode() for token in self.specials]
        try:
            self._enc = tiktoken.Encoding(path.name or "tiktoken", pat_str=KIMI_PATTERN,
                                          mergeable_ranks={piece: i for i, piece in enumerate(self._pieces)},
                                          special_tokens=self.special_ids)
        except (ValueError, AssertionError) as err:
            raise NanoError(f"cannot build the tiktoken tokenizer of {path}: {err}") from None
        self.bos_token_id = cfg.bos_token_id
        eos_text = _token_text(settings.get("eos_token"))
        self.eos_token_ids = _eos_token_ids(path, cfg, [self.special_ids[eos_text]] if eos_text in self.special_ids
                                            else [])
        source = _template_source(settings, path) or BUILTIN_TEMPLATES[cfg.family]
        self.chat_template = ChatTemplate(source, _token_text(settings.get("bos_token")), eos_text)

    def encode(self, text: str, specials: bool = True) -> list[int]:
        ids: list[int] = []
        for start in range(0, len(text), TIKTOKEN_MAX_CHARS):
            for chunk in split_long_runs(text[start:start + TIKTOKEN_MAX_CHARS], TIKTOKEN_MAX_RUN):
                ids.extend(self._enc.encode(chunk, allowed_special="all" if specials else set(), disallowed_special=()))
        return ids

    def decode(self, ids: list[int]) -> str:
        """Bytes are joined before decoding (a character may span tokens); ids past the vocabulary decode to ''."""
        table, size = self._bytes, len(self._bytes)
        return b"".join(table[i] for i in ids if 0 <= i < size).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        return list(self._bytes)


def read_tiktoken_ranks(file: Path) -> list[bytes]:
    """A tiktoken BPE file as the list of token bytes by rank. The ranks must be 0..n-1, each once: they are the ids."""
    if not file.is_file():
        raise NanoError(f"tiktoken.model not found in {file.parent}")
    try:
        lines = file.read_bytes().splitlines()
    except OSError as err:
        raise NanoError(f"cannot read {file}: {err}") from None
    by_rank: dict[int, bytes] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError
            piece, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error):
            got = line[:60].decode("utf-8", errors="replace")
            raise NanoError(f"{file} line {number}: expected 'base64-token rank', got {got!r}") from None
        if rank in by_rank:
            raise NanoError(f"{file} line {number}: rank {rank} appears twice")
        by_rank[rank] = piece
    if not by_rank:
        raise NanoError(f"{file} holds no tokens")
    if sorted(by_rank) != list(range(len(by_rank))):
        missing = min(set(range(len(by_rank))) - set(by_rank))
        raise NanoError(f"{file}: ranks must be 0..{len(by_rank) - 1} without gaps, but rank {missing} is missing")
    pieces = [by_rank[rank] for rank in range(len(by_rank))]
    if len(set(pieces)) != len(pieces):
        raise NanoError(f"{file}: a token's bytes appear under two ranks")
    return pieces


def tiktoken_specials(settings: dict[str, Any], base: int, file: Path) -> list[str]:
    """The names of the special ids base..base+255: `added_tokens_decoder` entries, else `<|reserved_token_{id}|>`."""
    declared = settings.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise NanoError(f"{file}: added_tokens_decoder must be an object of id -> token")
    names = {i: f"<|reserved_token_{i}|>" for i in range(base, base + TIKTOKEN_SPECIALS)}
    for key, entry in declared.items():
        content = _token_text(entry) if isinstance(entry, (str, dict)) else ""
        try:
            token_id = int(key)
        except ValueError:
            raise NanoError(f"{file}: added_tokens_decoder key {key!r} is not a token id") from None
        if not content:
            raise NanoError(f"{file}: added token {token_id} has no content")
        if token_id < base:
            raise NanoError(f"{file}: special token {content!r} has id {token_id}, which tiktoken.model already uses "
                            f"for a vocabulary token (ids 0..{base - 1}); special ids start at {base}")
        if token_id >= base + TIKTOKEN_SPECIALS:
            raise NanoError(f"{file}: special token {content!r} has id {token_id}, past the {TIKTOKEN_SPECIALS} "
                            f"special ids {base}..{base + TIKTOKEN_SPECIALS - 1}")
        names[token_id] = content
    specials = [names[i] for i in range(base, base + TIKTOKEN_SPECIALS)]
    repeated = sorted({token for token in specials if specials.count(token) > 1})
    if repeated:
        raise NanoError(f"{file}: special token {repeated[0]!r} is given more than one id")
    return specials


def split_long_runs(text: str, limit: int) -> list[str]:
    """`text` cut inside every run of more than `limit` whitespace (or non-whitespace) characters, every `limit`
    characters of the run, as Kimi's tokenizer does before encoding; shorter runs are never cut."""
    pieces, start, run, space = [], 0, 0, text[:1].isspace()
    for i, char in enumerate(text):
        if char.isspace() != space:
            run, space = 1, char.isspace()
        elif run == limit:
            pieces.append(text[start:i])
            start, run = i, 1
        else:
            run += 1
    return pieces + [text[start:]]


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: the printable Latin-1 bytes stand for themselves, the
    other 68 bytes for the characters 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + i): byte for i, byte in enumerate(others)}}


def _eos_token_ids(path: Path, cfg: ModelConfig, extra: list[int] | None = None) -> list[int]:
    """The ids that end a reply: config.json's, then generation_config.json's, then `extra`, each once."""
    given = read_json(path / "generation_config.json").get("eos_token_id")
    given = given if isinstance(given, list) else [] if given is None else [given]
    bad = [token_id for token_id in given if not is_token_id(token_id, cfg.vocab_size)]
    if bad:
        raise NanoError(f"generation_config.json: eos_token_id {bad[0]!r} is not a token id of the "
                        f"{cfg.vocab_size:,}-token vocabulary")
    return list(dict.fromkeys([*cfg.eos_token_ids, *given, *(extra or [])]))


def _template_source(settings: dict[str, Any], path: Path) -> str | None:
    """The checkpoint's chat template: tokenizer_config.json `chat_template` (a string or a list of named
    templates, of which "default" is used), else a chat_template.jinja file."""
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = path / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None


def _token_text(token: str | dict[str, Any] | None) -> str:
    """bos/eos in tokenizer_config.json are strings or serialized AddedToken dicts."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token or ""


class TextStream:
    """A reply's text as its tokens arrive: the one place text is assembled (`LLM.output`, `LLM.stream`, nano chat,
    the server). Tokens in `ends` (the token that ended the request) and the tokenizer's special tokens are not
    text (as vLLM's skip_special_tokens): a role marker the model emits is never shown. An incomplete UTF-8 character
    is held back until it completes; only a short window of ids is re-decoded per token, so streaming stays linear
    in the reply's length. `stop` strings cut the text before the first one found (`stopped` says so), and text
    that could still be the start of one is held back until it cannot. What `add` and `finish` return
    concatenates to `text`."""

    def __init__(self, tokenizer: Tokenizer, ends: set[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.hidden = ends | tokenizer.special_token_ids
        self.hold = max((len(s) - 1 for s in stop), default=0)
        self.ids: list[int] = []
        self.decoded = ""          # the text of every completed character so far
        self.text = ""             # of which released (the rest may still start a stop string)
        self.stopped = False       # a stop string was found
        self._prefix = 0           # window start: decoding ids from here gives text already decoded ...
        self._read = 0             # ... up to here

    def add(self, tokens: Sequence[int]) -> str:
        """The text these tokens release."""
        self.ids += [token for token in tokens if token not in self.hidden]
        new = self._window()
        if new and not new.endswith("\ufffd"):   # a character that still waits for its next bytes stays held
            self.decoded += new
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest, once the request has ended (an unfinished character decodes as U+FFFD)."""
        self.decoded += self._window()
        self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _window(self) -> str:
        """The text of the ids not yet decoded, in the context of the window before them."""
        decode = self.tokenizer.decode
        return decode(self.ids[self._prefix:])[len(decode(self.ids[self._prefix:self._read])):]

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        # an occurrence cannot start in released text: at least len(stop) - 1 characters were held back
        released = len(self.text)
        found = [i for i in (self.decoded.find(s, released) for s in self.stop) if i >= 0]
        self.stopped = bool(found)
        end = min(found) if found else max(released, len(self.decoded) - (0 if final else self.hold))
        self.text = self.decoded[:end]
        return self.text[released:]


def load_tokenizer(path: Path | None, cfg: ModelConfig) -> Tokenizer:
    """The checkpoint's tokenizer: tokenizer.json if it ships one, else tiktoken.model (Kimi); the family's byte
    tokenizer for a nano model (path None)."""
    if path is None:
        return ByteTokenizer(cfg.family)
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path, cfg)
    if (path / "tiktoken.model").is_file():
        return TiktokenTokenizer(path, cfg)
    tokenizer_class = read_json(path / "tokenizer_config.json").get("tokenizer_class")
    if tokenizer_class == "TikTokenTokenizer":
        raise NanoError(f"tiktoken.model not found in {path} (its tokenizer_config.json names TikTokenTokenizer)")
    if (path / "tokenizer.model").is_file():
        raise NanoError(f"tokenizer.json not found in {path} (sentencepiece tokenizer.model is not supported)")
    raise NanoError(f"no tokenizer in {path}: expected tokenizer.json or tiktoken.model")

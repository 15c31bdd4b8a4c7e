"""Byte and tokenizer.json tokenizers: round trips, special tokens, chat templates, streaming decode, errors."""

import pytest
from tokenizers import Tokenizer as RustTokenizer

from fixtures import GLM_SPECIALS, TEXT, build_tokenizer_dir

from nano.config import ModelConfig
from nano.errors import NanoError
from nano.presets import PRESETS
from nano.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDecoder, Tokenizer, load_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]


def nano_config(preset: str) -> ModelConfig:
    return ModelConfig.from_hf(PRESETS[preset].nano_config)


# ---- byte tokenizer -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["kimi", "glm"])
def test_byte_round_trip_and_sizes(family):
    tok = ByteTokenizer(family)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.vocab_size <= PRESETS["glm-5.2"].nano_config["vocab_size"]
    assert tok.bos_token_id is None


def test_byte_special_tokens_are_recognised():
    tok = ByteTokenizer("kimi")
    im_end = tok.special_ids["<|im_end|>"]
    assert tok.encode("a<|im_end|>é") == [97, im_end, 0xC3, 0xA9]
    assert tok.decode([97, im_end, 0xC3, 0xA9]) == "a<|im_end|>é"
    assert tok.encode("<|im_end") == list(b"<|im_end")   # an incomplete special string is plain text
    assert tok.eos_token_ids == [im_end, tok.special_ids["[EOS]"]]


def test_byte_eos_for_glm_includes_new_turn_tokens():
    tok = ByteTokenizer("glm")
    assert [tok.specials[i - 256] for i in tok.eos_token_ids] == ["<|endoftext|>", "<|user|>", "<|observation|>"]


def test_byte_decode_never_crashes():
    tok = ByteTokenizer("glm")
    assert tok.decode([0xFF, 0x61]) == "\ufffda"
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"
    assert tok.decode([0x61, 500, 0x62]) == "ab"         # ids past the tokenizer (model vocab 512) are empty


def test_kimi_chat_template():
    tok = load_tokenizer(None, nano_config("kimi-k2.6"))
    assert tok.render_chat(CHAT[:2]) == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                                         "<|im_user|>user<|im_middle|>Hi 🙂<|im_end|>"
                                         "<|im_assistant|>assistant<|im_middle|>")
    assert tok.render_chat(CHAT[:3], add_generation_prompt=False).endswith(
        "<|im_assistant|>assistant<|im_middle|>Hello.<|im_end|>")
    ids = tok.encode_chat(CHAT[:2])
    assert ids[0] == tok.special_ids["<|im_system|>"] and ids == tok.encode(tok.render_chat(CHAT[:2]))


def test_glm_chat_template():
    tok = load_tokenizer(None, nano_config("glm-5.2"))
    assert tok.render_chat(CHAT) == ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi 🙂<|assistant|>\nHello."
                                     "<|user|>\n2+2?<|assistant|>\n")
    assert tok.render_chat(CHAT[1:2], add_generation_prompt=False) == "[gMASK]<sop><|user|>\nHi 🙂"
    assert tok.encode_chat(CHAT[1:2])[:2] == [tok.special_ids["[gMASK]"], tok.special_ids["<sop>"]]


def test_builtin_template_rejects_unknown_role():
    with pytest.raises(NanoError, match="chat template rejected the conversation: unsupported chat role tool"):
        ByteTokenizer("glm").render_chat([{"role": "tool", "content": "x"}])


def test_unknown_family():
    with pytest.raises(NanoError, match="no byte tokenizer"):
        ByteTokenizer("llama")


# ---- incremental decoding ----------------------------------------------------------------------------------------

def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.step(ids[:n]) for n in range(1, len(ids) + 1)]
    return pieces + [decoder.flush()]


@pytest.mark.parametrize("text", [TEXT, "🙂", "a<|im_end|>b日本<|im_user|>", "x" * 50 + "é" * 30])
def test_incremental_bytes_emit_only_complete_text(text):
    tok = ByteTokenizer("kimi")
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    emoji = text.find("🙂")
    if emoji >= 0:  # the four bytes of the emoji arrive as one piece, on its last byte
        assert "🙂" in pieces


def test_incremental_holds_back_then_flushes_an_unfinished_character():
    tok = ByteTokenizer("glm")
    ids = [0x61] + list("🙂".encode())[:2]
    decoder = IncrementalDecoder(tok)
    assert [decoder.step(ids[:n]) for n in (1, 2, 3)] == ["a", "", ""]
    assert decoder.flush() == "\ufffd"
    assert decoder.flush() == ""


def test_incremental_passes_invalid_bytes_once_text_continues():
    tok = ByteTokenizer("glm")
    ids = [0xFF, 0x61, 0x62]
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "\ufffdab"


# ---- tokenizer.json checkpoints ----------------------------------------------------------------------------------

def glm_config(eos) -> ModelConfig:
    return ModelConfig.from_hf({**PRESETS["glm-4.7-flash"].nano_config, "eos_token_id": eos, "bos_token_id": None})


JINJA_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}"
                  "{% if message['role'] == 'system' and loop.first %}{{ bos_token }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_hf_tokenizer_encode_decode_and_specials(tmp_path):
    path = build_tokenizer_dir(tmp_path, {"chat_template": JINJA_TEMPLATE, "eos_token": "<|endoftext|>"},
                               generation_eos=[0, 4])
    tok = load_tokenizer(path, glm_config(eos=[0, 6]))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == [0, 6, 4]
    assert tok.bos_token_id is None and tok.vocab_size == RustTokenizer.from_file(str(path / "tokenizer.json")) \
        .get_vocab_size(with_added_tokens=True)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and not set(ids) & set(range(len(GLM_SPECIALS)))
    assert tok.encode("<|user|>hello") == [4] + tok.encode("hello")
    assert tok.decode([4]) == "<|user|>"


def test_hf_tokenizer_chat_template_from_config(tmp_path):
    config = {"chat_template": JINJA_TEMPLATE, "bos_token": {"content": "<sop>", "special": True}}
    tok = load_tokenizer(build_tokenizer_dir(tmp_path, config), glm_config(eos=0))
    assert tok.render_chat(CHAT[:2]) == "<|system|>Be brief.<sop><|user|>Hi 🙂<|assistant|>"
    assert tok.encode_chat(CHAT[:2])[:1] == [3]


def test_hf_tokenizer_named_templates_use_default(tmp_path):
    config = {"chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEF"}]}
    assert load_tokenizer(build_tokenizer_dir(tmp_path, config), glm_config(0)).render_chat(CHAT) == "DEF"


def test_hf_tokenizer_template_file_and_builtin_fallback(tmp_path):
    path = build_tokenizer_dir(tmp_path / "file", {})
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_tokenizer(path, glm_config(0)).render_chat(CHAT) == "Be brief.!"
    builtin = load_tokenizer(build_tokenizer_dir(tmp_path / "none"), glm_config(0))
    assert builtin.render_chat(CHAT[1:2]) == "[gMASK]<sop><|user|>\nHi 🙂<|assistant|>\n"


def test_hf_incremental_decoding(tmp_path):
    tok = load_tokenizer(build_tokenizer_dir(tmp_path), glm_config(0))
    text = TEXT + "<|user|>日本語 🙂 done"
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # the rare CJK characters span several byte-level tokens and were held back


def test_template_raise_exception_and_errors(tmp_path):
    config = {"chat_template": "{{ raise_exception('roles must alternate') }}"}
    tok = load_tokenizer(build_tokenizer_dir(tmp_path / "a", config), glm_config(0))
    with pytest.raises(NanoError, match="^chat template rejected the conversation: roles must alternate$"):
        tok.encode_chat(CHAT)
    with pytest.raises(NanoError, match="invalid chat template"):
        load_tokenizer(build_tokenizer_dir(tmp_path / "b", {"chat_template": "{% for %}"}), glm_config(0))
    broken = {"chat_template": "{{ messages[0].content.nope() }}"}
    with pytest.raises(NanoError, match="chat template failed"):
        load_tokenizer(build_tokenizer_dir(tmp_path / "c", broken), glm_config(0)).render_chat(CHAT)


def test_template_is_sandboxed(tmp_path):
    config = {"chat_template": "{{ messages.__class__.__mro__ }}"}
    tok = load_tokenizer(build_tokenizer_dir(tmp_path, config), glm_config(0))
    with pytest.raises(NanoError, match="unsafe"):
        tok.render_chat(CHAT)


def test_load_tokenizer_errors(tmp_path):
    cfg = glm_config(0)
    (tmp_path / "tiktoken.model").write_text("x")
    with pytest.raises(NanoError, match=r"^tokenizer.json not found in .* \(tiktoken-only checkpoints are not "
                                        r"supported yet\)$"):
        load_tokenizer(tmp_path, cfg)
    with pytest.raises(NanoError, match=r"^tokenizer.json not found in .*empty$"):
        (tmp_path / "empty").mkdir()
        load_tokenizer(tmp_path / "empty", cfg)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(NanoError, match="cannot read .*tokenizer.json"):
        load_tokenizer(tmp_path, cfg)
    path = build_tokenizer_dir(tmp_path / "badconfig")
    (path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(NanoError, match="cannot read .*tokenizer_config.json"):
        load_tokenizer(path, cfg)

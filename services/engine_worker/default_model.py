"""The default model: a small Llama checkpoint made locally, with a fixed seed, no network.

``make up`` and the tests run on it when no model is given. The weights are random (it
produces fluent-looking nonsense), but every file is a real Hugging Face artefact: a
``config.json`` that ``transformers`` loads, ``model.safetensors``, a byte-level BPE
``tokenizer.json`` trained here on a seeded synthetic corpus, and a ChatML chat template.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from lamina.libs.config import lamina_home

SEED = 0
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the a an and or but if then else when while for to of in on at by with from into over "
    "under about after before between through during without within along across behind "
    "i you he she it we they me him her us them my your his its our their this that these "
    "those who what which where why how all any some many much more most few less least "
    "one two three four five six seven eight nine ten first last next other same new old "
    "good great small large long short high low big little early late young right left "
    "is are was were be been being have has had do does did will would can could should may "
    "might must shall say said make made go went gone take took see saw know knew think "
    "thought come came give gave find found tell told ask asked work worked seem feel try "
    "leave call keep let begin help show hear play run move live believe bring happen write "
    "sit stand lose pay meet include continue set learn change lead understand watch follow "
    "stop create speak read spend grow open walk win offer remember love consider appear buy "
    "wait serve die send expect build stay fall cut reach kill remain suggest raise pass sell "
    "time year people way day man woman child world life hand part place case week company "
    "system program question government number night point home water room mother area money "
    "story fact month lot study book eye job word business issue side kind head house service "
    "friend father power hour game line end member law car city community name president team "
    "minute idea kid body information back parent face others level office door health person "
    "art war history party result morning reason research girl guy moment air teacher force "
    "model token request worker engine cache block batch stream queue server client message "
    "latency memory device kernel layer tensor prompt answer cluster network signal"
).split()


@dataclass(frozen=True)
class Preset:
    """Shape of a generated model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048


PRESETS = {
    # The default: fast enough for tests and `make up` on two CPU cores.
    "tiny": Preset(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384
    ),
    # Tens of millions of parameters: the benchmark model.
    "small": Preset(
        hidden_size=512, num_layers=10, num_heads=8, num_kv_heads=2, intermediate_size=2048
    ),
}
VOCAB_SIZE = 1024


def default_model_dir(preset: str = "tiny") -> Path:
    """Where the preset's checkpoint lives: ``$LAMINA_HOME/models/lamina-<preset>``
    (``LAMINA_HOME`` defaults to ``~/.cache/lamina``)."""
    return lamina_home() / "models" / f"lamina-{preset}"


def ensure_default_model(
    preset: str = "tiny", directory: Path | None = None, force: bool = False
) -> Path:
    """Create the preset's checkpoint unless a complete one is already there."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    directory = directory or default_model_dir(preset)
    if not force and (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    bos, eos = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    shape = PRESETS[preset]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": [eos, bos]}, indent=2)
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": shape.max_position_embeddings,
            },
            indent=2,
        )
    )
    tmp = directory / "model.safetensors.tmp"
    save_file(_random_weights(config), str(tmp), metadata={"format": "pt"})
    tmp.rename(directory / "model.safetensors")  # last: its presence marks a complete model
    return directory


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(SEED)
    corpus = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + "."
        for _ in range(4000)
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def _random_weights(config: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    tensors = {
        "model.embed_tokens.weight": normal(config["vocab_size"], h),
        "model.norm.weight": torch.ones(h),
    }
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        }
    return tensors

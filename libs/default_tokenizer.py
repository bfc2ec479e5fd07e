"""The default model's tokenizer: made locally from a seeded corpus, no torch, no network.

The gateway needs only the tokenizer of the default model, and must not import torch;
the worker makes the whole checkpoint (``engine_worker/default_model.py``) around it.
Both write the same files, atomically, so they may race to create them.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from lamina.libs.config import lamina_home

TOKENIZER_SEED = 0
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    # ChatML. With tools, a system turn lists them and asks for Hermes-style calls
    # (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, the gateway's default
    # parser); assistant turns show the calls they made, tool results come back as
    # ``<tool_response>`` user turns (as Qwen2.5's template writes them). A newline right
    # after a block tag is trimmed (``trim_blocks``), hence ``{{ '\n' }}`` there.
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
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


VOCAB_SIZE = 1024
MODEL_MAX_LENGTH = 2048
"""The context length every preset is made with."""


def default_model_dir(preset: str = "tiny") -> Path:
    """Where the preset's checkpoint lives: ``$LAMINA_HOME/models/lamina-<preset>``
    (``LAMINA_HOME`` defaults to ``~/.cache/lamina``)."""
    return lamina_home() / "models" / f"lamina-{preset}"


def ensure_default_tokenizer(directory: Path | None = None) -> Path:
    """Write the default tokenizer's files into ``directory`` (default: the ``tiny``
    preset's) unless they are there; return the directory."""
    directory = directory or default_model_dir()
    if not (directory / "tokenizer_config.json").exists():
        write_tokenizer(directory)
    return directory


def write_tokenizer(directory: Path):
    """Train the tokenizer and write ``tokenizer.json`` and ``tokenizer_config.json``;
    return the ``tokenizers.Tokenizer``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL_MAX_LENGTH,
    }
    _write_atomically(directory / "tokenizer.json", tokenizer.to_str(pretty=True))
    _write_atomically(directory / "tokenizer_config.json", json.dumps(config, indent=2))
    return tokenizer


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(TOKENIZER_SEED)
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

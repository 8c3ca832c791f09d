"""``liger-models chat``: a conversation in the terminal with a model, plain or with Medusa heads (the way Medusa's
own repository demonstrates its heads: an interactive chat with the speed of each reply).

Each line read is one user turn. The whole conversation so far (``--system`` first) is rendered with the chat
template training uses (the model's own or the built-in one: which, is logged at the start) and decoded; the reply
is printed and kept as the assistant's turn, so the next line continues the conversation. After every reply its
tokens/s (and, with Medusa, tokens per base-model forward) go to stderr. ``/reset`` starts a new conversation,
``/exit`` or end of input (Ctrl-D) ends the session. Settings and loading are those of ``liger-models generate``
(decoding.py).
"""

from __future__ import annotations

import argparse
import sys

from liger_models.recipes.configs import ChatConfig
from liger_models.recipes.decoding import (Decoded, describe_rate, encode_conversation, locate, open_decoder,
                                           tokenizer_and_specials)
from liger_models.text.chat import chat_template_note

PROMPT = "USER: "
REPLY = "ASSISTANT: "


def run_chat(config: ChatConfig | argparse.Namespace, stdin=None, out=None, log=None) -> list[dict]:
    """The chat loop (module docstring); returns the conversation as it stands when the session ends. A parsed
    command line (cli.build_parser) is taken too, as its config."""
    stdin, out, log = stdin or sys.stdin, out or sys.stdout, log or sys.stderr
    config = ChatConfig.coerce(config)
    config.validate()
    sources = locate(config.model, config.medusa, config.adapter)
    tokenizer, special = tokenizer_and_specials(sources.tokenizer_dir)
    print(chat_template_note(special, config.chat_template), file=log, flush=True)  # refuses a missing model template
    opening = [{"role": "system", "content": config.system}] if config.system else []
    encode_conversation(opening + [{"role": "user", "content": "Hi"}], tokenizer, special,
                        config.chat_template)  # the template's mistakes (no template, a refused system turn) come now
    decoder = open_decoder(config, sources, tokenizer, log)
    interactive = stdin.isatty()
    messages = list(opening)
    warmed = False
    while True:
        if interactive:
            print(PROMPT, end="", file=out, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            break
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages = list(opening)
            print("(a new conversation)", file=log, flush=True)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids = encode_conversation(messages, tokenizer, special, config.chat_template)
        if not warmed:  # once, untimed: kernels compiled, a graph captured
            decoder.warm_up([ids])
            warmed = True
        reply = decoder(ids)
        messages.append({"role": "assistant", "content": reply.text})
        print(f"{REPLY}{reply.text}", file=out, flush=True)
        print(_reply_stats(reply, len(ids)), file=log, flush=True)
    return messages


def _reply_stats(reply: Decoded, prompt_tokens: int) -> str:
    line = f"[{prompt_tokens}-token conversation] {describe_rate(reply)}"
    if reply.tokens_per_step is not None:
        line += f", {reply.tokens_per_step:.2f} tokens per base-model forward"
    return line

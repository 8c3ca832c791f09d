"""`liger-models chat`: each reply is plain (or Medusa) decoding of the whole conversation so far, rendered as
training renders chat; /reset, /exit and end of input; mistakes refused before any weights load."""

from __future__ import annotations

import io

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.hub import load_tokenizer  # the fast tokenizer itself
from liger_models.recipes.chat import PROMPT, REPLY, run_chat
from liger_models.cli import build_parser, main
from liger_models.recipes.decoding import encode_conversation
from liger_models.train.data import read_special_tokens

pytestmark = pytest.mark.usefixtures("reference_path")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _chat(argv, lines, stdin_type=io.StringIO):
    out, log = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["chat", "--device", "cpu", "--greedy", "--max-new-tokens", "6", *argv])
    messages = run_chat(args, stdin=stdin_type("".join(line + "\n" for line in lines)), out=out, log=log)
    return messages, out.getvalue(), log.getvalue()


def _reply(model_dir, messages) -> str:
    """Plain greedy decoding of the conversation, as the library does it."""
    tokenizer = load_tokenizer(model_dir)
    ids = torch.tensor([encode_conversation(messages, tokenizer, read_special_tokens(tokenizer, model_dir))])
    base = AutoLigerForCausalLM.from_pretrained(model_dir)
    new = base.generate(ids, 6, do_sample=False, attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
    return tokenizer.decode(new.tolist(), skip_special_tokens=True)


def test_each_reply_continues_the_whole_conversation(tiny_model_dir):
    messages, out, log = _chat(["--model", str(tiny_model_dir), "--system", "Be brief."],
                               ["Who art thou?", "", "And whence?"])
    system = {"role": "system", "content": "Be brief."}
    first = _reply(tiny_model_dir, [system, {"role": "user", "content": "Who art thou?"}])
    turns = [system, {"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": first},
             {"role": "user", "content": "And whence?"}]
    second = _reply(tiny_model_dir, turns)
    assert messages == turns + [{"role": "assistant", "content": second}]  # the blank line was no turn
    assert out == f"{REPLY}{first}\n{REPLY}{second}\n" and PROMPT not in out  # no prompt when stdin is not a tty
    assert log.count("tokens/s") == 2


def test_reset_exit_and_the_terminal_prompt(tiny_model_dir):
    messages, out, log = _chat(["--model", str(tiny_model_dir)], ["Who art thou?", "/reset", "Speak.", "/exit",
                                                                  "never read"], stdin_type=Terminal)
    speak = [{"role": "user", "content": "Speak."}]
    assert messages == speak + [{"role": "assistant", "content": _reply(tiny_model_dir, speak)}]
    assert out.count(PROMPT) == 4 and "(a new conversation)" in log  # asked before each line read, /exit included


def test_medusa_replies_are_the_plain_greedy_replies(tiny_model_dir, heads_dir):
    plain, _, _ = _chat(["--model", str(tiny_model_dir)], ["Who art thou?", "Speak on."])
    medusa, _, log = _chat(["--medusa", str(heads_dir)], ["Who art thou?", "Speak on."])
    assert medusa == plain and "default tree" in log and log.count("tokens per base-model forward") == 2


@pytest.mark.parametrize("argv, message", [
    (["--chat-template", "model"], "has no chat_template"),
    (["--greedy", "--temperature", "0.5"], "contradicts"),
    (["--default-tree"], "give --medusa"),
    (["--medusa", "{heads}", "--top-k", "4"], "plain decoding only"),
])
def test_mistakes_are_refused_before_loading(argv, message, tiny_model_dir, heads_dir, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the mistake was found")

    monkeypatch.setattr(AutoLigerForCausalLM, "from_pretrained", no_loading)
    argv = [a.format(heads=heads_dir) for a in argv]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    code = main(["chat", "--device", "cpu", "--model", str(tiny_model_dir), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("liger-models: error: ") and message in err

"""`rvrun chat`: one conversation with a Model through its chat template, in a terminal or over a
pipe.

Each line read is a user turn (an empty line is skipped; `/reset` forgets the conversation but
the system message). The whole history is rendered by the template and the answer streamed as it
is generated, ending at the model's end of turn (Model.chat_stop) or after `max_tokens`; it
joins the history. A turn the model cannot take (the conversation no longer fits the context,
the template refuses it) prints one `rvrun: error:` line and is left out of the history; the
session goes on. Ctrl-C while an answer is written stops it (what was written stays in the
history); at the prompt it clears the line. Ctrl-D, or the end of the input, ends the session
(exit 0). A failure of the engine ends it with 1.
"""

from __future__ import annotations

import signal
from typing import Any, TextIO

from rvcompile.runtime.model import Model

PROMPT = "> "


class ChatSession:
    def __init__(self, model: Model, *, system: str | None, max_tokens: int,
                 sampling: dict[str, Any]):
        self.model, self.max_tokens, self.sampling = model, max_tokens, sampling
        self.opening = [] if system is None else [{"role": "system", "content": system}]
        self.history: list[dict] = list(self.opening)
        self._answering = False  # Ctrl-C now stops the answer rather than clearing the line
        self._stop = False  # Ctrl-C came during the answer

    def run(self, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
        """Read turns from `stdin` until its end; returns the exit code."""
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        terminal = stdin.isatty() and stdout.isatty()
        if terminal:
            import readline  # noqa: F401  (line editing and history for input())
        try:
            while True:
                try:
                    line = input(PROMPT) if terminal else stdin.readline()
                except EOFError:
                    line = ""
                except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line
                    stdout.write("\n")
                    stdout.flush()
                    continue
                if not line:  # the end of the input
                    if terminal:
                        stdout.write("\n")
                        stdout.flush()
                    return 0
                line = line.rstrip("\n")
                if line.strip() == "/reset":
                    self.history = list(self.opening)
                    continue
                if line.strip():
                    status = self.turn(line, stdout, stderr)
                    if status:
                        return status
        finally:
            signal.signal(signal.SIGINT, previous)

    def turn(self, text: str, stdout: TextIO, stderr: TextIO) -> int:
        """One user turn and the streamed answer; returns 0, or 1 if the engine failed."""
        messages = [*self.history, {"role": "user", "content": text}]
        answer: list[str] = []
        self._stop = False
        self._answering = True
        try:
            ids = self.model.encode(self.model.apply_chat_template(messages), add_bos=False)
            for piece in self.model.generate_stream(ids, max_tokens=self.max_tokens, chat=True,
                                                    **self.sampling):
                answer.append(piece)
                stdout.write(piece)
                stdout.flush()
                if self._stop:
                    break
        except RuntimeError as e:  # the engine failed this generation
            stderr.write(f"\nrvrun: error: {str(e).splitlines()[0]}\n")
            return 1
        except ValueError as e:  # the context is full, the template refused the turn
            stderr.write(f"rvrun: error: {str(e).splitlines()[0]}\n")
            return 0
        finally:
            self._answering = False
        stdout.write("\n")
        stdout.flush()
        self.history = [*messages, {"role": "assistant", "content": "".join(answer)}]
        return 0

    def _on_interrupt(self, signum: int, frame) -> None:
        if self._answering:
            self._stop = True
        else:
            raise KeyboardInterrupt

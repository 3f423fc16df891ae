"""OpenAI's harmony response format (gpt-oss): the assistant's text split into its channels.

After the chat template's ``<|start|>assistant`` a gpt-oss model writes one or more messages,
each ``[<|start|>assistant]<|channel|>NAME<|message|>TEXT`` closed by ``<|end|>`` (another
message follows), ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call).  The
``analysis`` channel is its chain of thought; ``final`` is the answer (``commentary`` holds
tool calls and their preambles).  `HarmonyChannels` turns the decoded text, as it streams,
into reasoning (analysis) and content (every other channel) with the markers taken out: what
`moeshard serve` returns as ``reasoning_content`` and ``content``, and what `generate --chat`
prints.
"""

from __future__ import annotations

MODEL_TYPES = ("gpt_oss",)
START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, *ENDS)
REASONING_CHANNELS = ("analysis",)


def speaks_harmony(model_type: str) -> bool:
    return model_type in MODEL_TYPES


class HarmonyChannels:
    """Streamed assistant text in, (reasoning, content) deltas out.  A message's header
    (``<|channel|>final``, ``assistant<|channel|>analysis``...) is held until its
    ``<|message|>``, a partial marker until it is whole; `flush` gives what is left (text
    that never opened a message is content: a model that did not answer in harmony)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_body = False  # between a <|message|> and the marker that ends it
        self.reasoning = False  # the open message's channel is a reasoning one

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        out: dict[bool, list[str]] = {True: [], False: []}
        while self.buffer:
            if not self.in_body:
                at = self.buffer.find(MESSAGE)
                if at < 0:
                    break  # the header goes on
                self._open(self.buffer[:at])
                self.buffer = self.buffer[at + len(MESSAGE) :]
                continue
            at = self.buffer.find("<|")
            if at < 0:
                keep = 1 if self.buffer.endswith("<") else 0  # (a marker may start there)
                out[self.reasoning].append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            out[self.reasoning].append(self.buffer[:at])
            self.buffer = self.buffer[at:]
            marker = next((m for m in MARKERS if self.buffer.startswith(m)), None)
            if marker is None:
                if any(m.startswith(self.buffer) for m in MARKERS):
                    break  # a marker may be arriving
                out[self.reasoning].append(self.buffer[:2])  # "<|" that starts no marker
                self.buffer = self.buffer[2:]
                continue
            if marker in ENDS or marker == START:
                self.in_body = False  # (the next header follows)
                self.buffer = self.buffer[len(marker) :]
            else:  # a channel or message marker inside a body: a new header begins
                self.in_body = False
        return "".join(out[True]), "".join(out[False])

    def _open(self, header: str) -> None:
        for end in ENDS:
            header = header.replace(end, "")
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else "final"
        name = channel.split()[0] if channel.split() else "final"  # "commentary to=..."
        self.reasoning = name in REASONING_CHANNELS
        self.in_body = True

    def flush(self) -> tuple[str, str]:
        """What is left at the end: an open body's text (a cut-off answer), or text that
        never opened a message, as content."""
        rest, self.buffer = self.buffer, ""
        if self.in_body:
            return (rest, "") if self.reasoning else ("", rest)
        if START in rest or CHANNEL in rest:
            return "", ""  # a header cut off before its message
        return "", rest


def split(text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    channels = HarmonyChannels()
    reasoning, content = channels.feed(text)
    more_reasoning, more_content = channels.flush()
    return reasoning + more_reasoning, content + more_content

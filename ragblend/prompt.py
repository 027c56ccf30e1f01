"""Prompt layout in token ids: [template head + system + user prefix][chunk 1][sep]…[chunk k][tail].

Each piece is tokenised on its own and the ids concatenated, so every mode runs on exactly the
same ids and chunk boundaries come from the caller, never from parsing a joined string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ragblend.errors import RagblendError

DEFAULT_SYSTEM = (
    "You will be asked a question after reading several passages. Please directly answer the "
    "question based on the given passages. Do NOT repeat the question. The answer should be "
    "within 5 words."
)
_MARK = "\x00RAGBLEND_USER_CONTENT\x00"

# A neutral, encyclopedic passage placed before each chunk when its KV is precomputed with
# ``precompute_context="filler"``: the chunk then attends over a passage-like context, as it
# will in a real prompt, instead of over the system prompt alone.
FILLER_PASSAGE = (
    "The river rises in the northern hills and flows south through a broad valley before "
    "reaching the sea. Settlements along its banks date from the early medieval period, when "
    "mills and bridges were built at several crossings. The largest town in the valley grew "
    "around a market established in the twelfth century, and a parish church, a grammar "
    "school and a town hall were added over the following centuries. In the nineteenth "
    "century the arrival of the railway brought new industries, including brewing, textile "
    "manufacture and engineering, and the population more than doubled. Many of the older "
    "buildings survive and are now protected. The valley is also known for its varied "
    "wildlife, and parts of it have been designated as nature reserves. Local history "
    "societies have published several accounts of the area, drawing on parish records, "
    "maps, newspapers and the recollections of residents. Today the economy depends mainly "
    "on services, tourism and agriculture, and the town serves as the administrative centre "
    "for the surrounding district."
)


@dataclass(frozen=True)
class PromptFormat:
    """How the user message is laid out: ``prefix + chunk1 + separator + … + suffix``.

    ``suffix`` may contain ``{question}``. ``system`` is the system message (None: the chat
    template's own default, if any).
    """

    system: str | None = DEFAULT_SYSTEM
    prefix: str = ""
    separator: str = "\n\n"
    suffix: str = (
        "\n\nAnswer the question directly based on the given passages. Do NOT repeat the "
        "question. The answer should be within 5 words.\nQuestion: {question}"
    )

    @classmethod
    def from_template(
        cls,
        template: str,
        context_var: str = "context_str",
        question_var: str = "query_str",
        separator: str = "\n\n",
        system: str | None = None,
    ) -> PromptFormat:
        """Build a format from a ``str.format`` template with a context and a question slot."""
        marker = "\x01CTX\x01"
        try:
            text = template.format(**{context_var: marker, question_var: "{question}"})
        except KeyError as exc:
            raise RagblendError(f"template has an unknown placeholder {exc}") from None
        if text.count(marker) != 1:
            raise RagblendError(f"template must contain {{{context_var}}} exactly once")
        before, after = text.split(marker)
        return cls(system=system, prefix=before, separator=separator, suffix=after)

    def user_text(self, chunks: list[str], question: str) -> str:
        return self.prefix + self.separator.join(chunks) + self.suffix.format(question=question)


@dataclass
class TokenizedPrompt:
    head: list[int]
    chunks: list[list[int]]
    separator: list[int]
    tail: list[int]
    chunk_texts: list[str] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        out = list(self.head)
        for i, chunk in enumerate(self.chunks):
            if i:
                out += self.separator
            out += chunk
        return out + self.tail

    def __len__(self) -> int:
        return len(self.ids)


def split_chat_template(tokenizer, system: str | None) -> tuple[str, str]:
    """Text of the chat template before and after the user message's content."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": _MARK}
    ]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = (system + "\n\n" if system else "") + _MARK + "\n"
    if text.count(_MARK) != 1:
        raise RagblendError("the chat template does not render the user message verbatim")
    head, tail = text.split(_MARK)
    return head, tail


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def tokenize_prompt(
    tokenizer, fmt: PromptFormat, chunks: list[str], question: str
) -> TokenizedPrompt:
    """Tokenise each piece separately; exactly one BOS at position 0 when the model uses one."""
    if not chunks:
        raise RagblendError("no chunks given: pass at least one retrieved chunk")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, str) or not chunk.strip():
            raise RagblendError(f"chunk {i} is empty")
    template_head, template_tail = split_chat_template(tokenizer, fmt.system)
    head = encode(tokenizer, template_head + fmt.prefix)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and _adds_bos(tokenizer) and (not head or head[0] != bos):
        head = [bos] + head
    chunk_ids = [encode(tokenizer, c) for c in chunks]
    for i, ids in enumerate(chunk_ids):
        if not ids:
            raise RagblendError(f"chunk {i} tokenises to no tokens")
    tail = encode(tokenizer, fmt.suffix.format(question=question) + template_tail)
    return TokenizedPrompt(
        head=head,
        chunks=chunk_ids,
        separator=encode(tokenizer, fmt.separator),
        tail=tail,
        chunk_texts=list(chunks),
    )


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat messages with the generation prompt (plain text without a template)."""
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(enc["input_ids"])
    return encode(tokenizer, "\n\n".join(m["content"] for m in messages) + "\n")


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


# The context chunks are precomputed after with ``precompute_context="canonical"``: the chat
# template's head with a fixed neutral system prompt, whatever template the user's prompt uses,
# so a chunk's cache hits under any template; the fused prefill corrects for the real head.
CANONICAL_SYSTEM = "You are a helpful assistant. Read the passages below."
CANONICAL_FORMAT = PromptFormat(system=CANONICAL_SYSTEM, prefix="")

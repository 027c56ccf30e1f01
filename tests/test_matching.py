"""Content-addressed chunk matching: exact spans, no separator parsing, per-context scoping."""

from __future__ import annotations

import contextvars
import threading

from ragblend.matching import (
    ChunkIndex,
    add_retrieved,
    clear_retrieved,
    current_retrieved,
    find_chunks,
    split_text,
)

A = "title: a\n\nParis is the capital of France and its largest city."
B = "title: b\n\nBerlin is the capital of Germany, on the river Spree."
C = "title: c\n\nMadrid is the capital of Spain, in the centre of the country."


def test_known_chunks_are_found_as_exact_spans_and_split_with_their_separator():
    index = ChunkIndex()
    index.add([A, B, C])
    prompt = "Context:\n---\n" + A + "\n\n" + B + "\n---\nQuery: capital?"
    split = split_text(prompt, find_chunks(prompt, index))
    assert split.chunks == [A, B] and split.separator == "\n\n"
    assert split.before == "Context:\n---\n" and split.after == "\n---\nQuery: capital?"


def test_edited_chunk_text_is_not_matched():
    index = ChunkIndex()
    index.add([A])
    assert find_chunks(A.replace("Paris", "Lyon"), index) == []


def test_mixed_between_texts_keep_the_longest_uniform_run():
    prompt = A + "\n\n" + B + "\n\n" + C + " | " + A
    split = split_text(prompt, find_chunks(prompt, retrieved=[A, B, C]))
    assert split.chunks == [A, B, C] and split.after == " | " + A


def test_retrieved_sets_do_not_leak_between_threads():
    clear_retrieved()
    add_retrieved([A])
    seen = {}

    def other() -> None:
        add_retrieved([B])
        seen["other"] = current_retrieved()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(other,))
    thread.start()
    thread.join()
    assert current_retrieved() == (A,)
    assert seen["other"] == (A, B)
    clear_retrieved()


def test_chunks_inside_a_formatted_python_list_are_found_in_their_escaped_form():
    # LlamaIndex simple_summarize formats ["\n".join(chunks)] into its template
    quoted = B.replace("Berlin", "'Berlin'")  # a quote switches repr to double quotes
    for chunks in ([A, B, C], [A, quoted, C]):
        prompt = "Context:\n" + str(["\n".join(chunks)]) + "\nQuery: capital?"
        index = ChunkIndex()
        index.add(chunks)
        for spans in (find_chunks(prompt, index), find_chunks(prompt, retrieved=chunks)):
            split = split_text(prompt, spans)
            assert len(split.chunks) == 3 and split.separator == "\\n"
            # the chunk is the text as the prompt holds it: the fused text is the prompt
            assert split.before + "\\n".join(split.chunks) + split.after == prompt
            assert split.chunks[0] == A.replace("\n", "\\n")

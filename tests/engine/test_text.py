from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvwarm.engine.text import TextAssembler, piece_bytes, piece_text


def run(pieces: list[bytes], stop: tuple[str, ...] = ()) -> tuple[str, str]:
    asm = TextAssembler(stop)
    out = "".join(asm.feed(p) for p in pieces) + asm.finish()
    return out, asm.text


def test_multibyte_character_split_across_tokens_is_emitted_whole() -> None:
    euro = "€".encode()  # 3 bytes
    asm = TextAssembler(())
    assert asm.feed(euro[:1]) == ""
    assert asm.feed(euro[1:2]) == ""
    assert asm.feed(euro[2:]) == "€"


def test_stop_sequence_straddling_tokens_is_never_emitted() -> None:
    out, text = run([b"Hello wo", b"rld", b"END", b"ignored"], stop=("ldEN",))
    assert text == "Hello wor"
    assert out == text


def test_the_stop_that_matched_first_is_reported() -> None:
    asm = TextAssembler(("zz", "lo w", "o"))
    asm.feed(b"Hello world")
    assert asm.stopped and asm.text == "Hel" and asm.matched == "lo w"  # the earliest
    plain = TextAssembler(("zz",))
    plain.feed(b"Hello")
    assert plain.finish() and plain.matched is None


def test_held_back_text_is_released_at_finish() -> None:
    out, text = run([b"abc", b"E"], stop=("EN",))
    assert out == text == "abcE"


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` in pieces of the lengths ``cuts`` says, the rest last (a token's bytes each)."""
    pieces, i = [], 0
    for c in cuts:
        pieces.append(data[i : i + c])
        i += c
    pieces.append(data[i:])
    return pieces


@given(
    st.text(max_size=40), st.lists(st.integers(1, 5), max_size=20), st.text(min_size=1, max_size=4)
)
def test_fragments_concatenate_to_the_final_text(text: str, cuts: list[int], stop: str) -> None:
    pieces = _cut(text.encode(), cuts)
    out, final = run(pieces, stop=(stop,))
    assert out == final
    assert stop not in final
    expected = text.split(stop, maxsplit=1)[0] if stop in text else text
    assert final == expected


def test_a_character_cut_at_the_end_is_dropped_not_replaced() -> None:
    smile = "😊".encode()
    out, text = run([b"Hi ", smile[:2]])
    assert out == text == "Hi "
    out, text = run([b"Hi ", smile[:2], smile[2:]])
    assert out == text == "Hi 😊"


def test_invalid_bytes_inside_the_text_stay_visible() -> None:
    out, text = run([b"a\xffb"])
    assert out == text == "a\ufffdb"


@given(st.binary(max_size=8))
def test_piece_text_round_trips_and_never_invents_replacements(piece: bytes) -> None:
    text = piece_text(piece)
    assert piece_bytes(text) == piece
    assert "\ufffd" not in text or "\ufffd".encode() in piece


def test_ascii_pieces_skip_the_decoder_but_not_a_pending_character() -> None:
    """An ASCII piece is decoded directly unless the decoder holds part of a character; the
    text is what one incremental UTF-8 decoder (errors="replace") gives for every split,
    held-over bytes included (an ASCII byte right after a cut character ends it as U+FFFD)."""
    import codecs
    import random

    rng = random.Random(7)
    alphabet = [b"a", b" ", b"\xc3", b"\xa9", b"\xf0", b"\x9f", b"\x98", b"\x80", b"\xff", b"z"]
    for _ in range(300):
        pieces = [b"".join(rng.choices(alphabet, k=rng.randint(0, 3))) for _ in range(8)]
        ref = codecs.getincrementaldecoder("utf-8")(errors="replace")
        expected = "".join(ref.decode(p) for p in pieces)
        asm = TextAssembler(())
        out = "".join(asm.feed(p) for p in pieces)
        assert out + asm.finish() == expected, pieces
    asm = TextAssembler(())
    assert [asm.feed(p) for p in (b"a", b"\xf0\x9f", b"\x98", b"\x80", b"b")] == [
        "a", "", "", "\U0001f600", "b"
    ]  # fmt: skip
    asm = TextAssembler(())
    assert asm.feed(b"\xc3") + asm.feed(b"a") == "\ufffda"


def test_begun_counts_the_tokens_of_the_returned_text() -> None:
    # The logprobs a reply keeps after a stop: the tokens whose text starts before the stop,
    # one holding the text's end and the stop's start included; none of the stop alone.
    asm = TextAssembler(("STOP",))
    for piece in (b"ab", b"cS", b"TO", b"P!"):
        asm.feed(piece)
    assert asm.stopped and asm.text == "abc" and asm.begun() == 2
    # A character split across tokens: both start where it does, neither counts before it
    # goes out.
    asm = TextAssembler(())
    asm.feed("é".encode()[:1])
    assert asm.begun() == 0
    asm.feed("é".encode()[1:])
    assert asm.begun() == 2
    # Held back as a possible stop: not begun until released.
    asm = TextAssembler(("xy",))
    asm.feed(b"a")
    asm.feed(b"x")
    assert asm.begun() == 1
    asm.feed(b"z")
    assert asm.begun() == 2


def indent_cut(text: str, n_indent: int) -> str:
    """llama-server's ``n_indent`` cut of a whole text, written plainly: at the first
    character other than a space or a tab of the first line after a newline indented less."""
    pos = text.find("\n")
    while pos != -1:
        start = at = pos + 1
        while at < len(text) and text[at] in " \t":
            at += 1
        if at < len(text) and at - start < n_indent:
            return text[:at]
        pos = text.find("\n", start)
    return text


def test_a_line_indented_less_than_n_indent_ends_the_text_there() -> None:
    asm = TextAssembler((), n_indent=4)
    assert asm.feed(b"  x\n    y") == "  x\n    y"  # the first line is never checked
    assert asm.feed(b"\n  ") == "\n  "  # indentation alone decides nothing yet
    assert asm.feed(b"zw") == "" and asm.stopped and asm.indent_cut
    assert asm.text == "  x\n    y\n  " and asm.matched is None
    assert asm.feed(b"more") == ""


def test_an_earlier_stop_sequence_wins_over_a_later_indent_cut() -> None:
    asm = TextAssembler(("y",), n_indent=4)
    asm.feed(b"a\n    y\nb")
    assert asm.text == "a\n    " and asm.matched == "y" and not asm.indent_cut
    asm = TextAssembler(("b",), n_indent=4)
    asm.feed(b"a\n  y\nb")
    assert asm.text == "a\n  " and asm.matched is None and asm.indent_cut


@given(
    st.text(alphabet="ab \t\n", max_size=40),
    st.lists(st.integers(1, 5), max_size=20),
    st.integers(1, 4),
    st.sampled_from(["", "b\n", "\t"]),
)
def test_indent_cut_fragments_are_the_text_and_the_text_is_llama_servers(
    text: str, cuts: list[int], n_indent: int, stop: str
) -> None:
    pieces = _cut(text.encode(), cuts)
    asm = TextAssembler((stop,) if stop else (), n_indent=n_indent)
    out = "".join(asm.feed(p) for p in pieces) + asm.finish()
    assert out == asm.text
    expected = text.split(stop, maxsplit=1)[0] if stop else text
    assert asm.text == indent_cut(expected, n_indent)

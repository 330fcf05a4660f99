"""StopChecker alone (any split of the text into pieces) and inside ReqStream (token-aligned
deltas, finish reasons, dropped tokens after a stop)."""
from __future__ import annotations

import random

from lightserve.detokenizer.req_stream import ReqStream
from lightserve.detokenizer.stop_strings import StopChecker
from lightserve.messages import FinishReason


def run(stop, pieces):
    """(texts emitted per piece, stopped, text released at finish)."""
    checker = StopChecker(stop)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = checker.push(piece)
        out.append(text)
        if stopped:
            break
    return out, stopped, ("" if stopped else checker.finish())


def expected(stop, text):
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def test_stop_spanning_pieces():
    out, stopped, tail = run(["world"], ["Hello wo", "r", "ld and more"])
    assert out == ["Hello ", "", ""] and stopped and tail == ""


def test_stop_string_not_included_and_rest_of_piece_dropped():
    out, stopped, _ = run(["\n\n"], ["one\n", "\ntwo"])
    assert "".join(out) == "one" and stopped


def test_several_stop_strings_earliest_wins():
    out, stopped, _ = run(["cat", "og c", "dog"], ["the d", "og cat"])  # at 8, 5 and 4
    assert "".join(out) == "the " and stopped
    out, _, _ = run(["b", "abc"], ["xab", "c"])
    assert "".join(out) == "xa"


def test_stop_at_very_start():
    out, stopped, _ = run(["Hi"], ["Hi there"])
    assert out == [""] and stopped
    out, stopped, _ = run(["<"], ["<", "tag>"])
    assert out == [""] and stopped


def test_held_prefix_released_when_it_diverges_or_at_finish():
    out, stopped, tail = run(["STOP"], ["go ST", "O"])
    assert out == ["go ", ""] and not stopped and tail == "STO"
    out, stopped, tail = run(["STOP"], ["go ST", "ART"])
    assert out == ["go ", "START"] and not stopped and tail == ""


def test_overlapping_prefixes_hold_the_longest_tail():
    # "aab": after "xaa" the tail "aa" is a prefix, so nothing of it may be shown yet.
    out, stopped, _ = run(["aab"], ["xaa", "ab"])
    assert out == ["x", "a"] and stopped


def test_no_stop_strings_pass_through():
    assert run([], ["a", "b"]) == (["a", "b"], False, "")


def test_random_splits_never_show_cut_text():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab c😀") for _ in range(rng.randrange(0, 20)))
        stop = ["".join(rng.choice("ab c😀") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out, stopped, tail = run(stop, pieces)
        want, want_stopped = expected(stop, text)
        shown = ""
        for piece in out:
            shown += piece
            assert want.startswith(shown), (text, stop, pieces)  # never shows what a stop later cuts
        assert shown + tail == want and stopped == want_stopped, (text, stop, pieces)


# ---- inside ReqStream -----------------------------------------------------------------------------
def stream(tokenizer, stop, prompt="User: hi\nAssistant:"):
    return ReqStream(0, 7, tokenizer, tokenizer.encode(prompt, add_special_tokens=False),
                     skip_special_tokens=True, stop=stop)


def test_req_stream_stop_across_tokens_drops_later_tokens(smol_tokenizer):
    ids = smol_tokenizer.encode(" The answer is 42. Done here.", add_special_tokens=False)
    s = stream(smol_tokenizer, ["42."])
    d = s.advance(ids, [-0.5] * len(ids), FinishReason.NONE)
    assert d.text == " The answer is " and d.finish == FinishReason.STOP
    assert "".join(d.token_texts) == d.text and len(d.token_texts) == len(d.token_ids) == len(d.logprobs)
    assert d.num_output == len(d.token_ids) < len(ids)
    assert smol_tokenizer.decode(d.token_ids).endswith("42.")  # up to the token completing the stop


def test_req_stream_holds_prefix_then_releases_at_finish(smol_tokenizer):
    ids = smol_tokenizer.encode(" Hello wor", add_special_tokens=False)
    s = stream(smol_tokenizer, ["world"])
    first = s.advance(ids[:-1], [0.0] * (len(ids) - 1), FinishReason.NONE)
    held = s.advance(ids[-1:], [0.0], FinishReason.NONE)
    assert first.text == " Hello" and held.token_texts == [" "]  # " wor": the space is safe, "wor" held
    final = s.advance([], [], FinishReason.LENGTH)
    assert final.text == "wor" and final.finish == FinishReason.LENGTH and final.num_output == len(ids)


def test_req_stream_tail_joins_last_token_text(smol_tokenizer):
    ids = smol_tokenizer.encode(" go wor", add_special_tokens=False)
    d = stream(smol_tokenizer, ["world"]).advance(ids, [0.0] * len(ids), FinishReason.STOP)
    assert d.text == " go wor" and "".join(d.token_texts) == d.text and d.finish == FinishReason.STOP


def test_req_stream_stop_in_first_token(smol_tokenizer):
    ids = smol_tokenizer.encode(" Sure, here", add_special_tokens=False)
    d = stream(smol_tokenizer, [" Sure"]).advance(ids, [0.0] * len(ids), FinishReason.NONE)
    assert d.text == "" and d.finish == FinishReason.STOP and d.num_output == 1

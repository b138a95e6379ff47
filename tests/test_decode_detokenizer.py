"""The decode server's streamed text: deltas that never take back what was sent, whose sum is
the whole answer's text, with characters split over several tokens held until complete."""

from __future__ import annotations

from prefill_node.decode.http_server import _Detokenizer
from prefill_node.model.tokenizer import Tokenizer

TEXT = "Pizza 🍕, globe 🌍 and naïve café — done."


def test_streamed_deltas_add_up_to_the_text_and_never_hold_half_a_character(default_model_dir):
    tokenizer = Tokenizer.from_dir(default_model_dir)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # the emoji take several byte-level tokens each: a token alone is half a character
    assert any("\ufffd" in tokenizer.decode(ids[: i + 1]) for i in range(len(ids)))
    detok = _Detokenizer(tokenizer)
    deltas = [detok.add(token) for token in ids]
    deltas.append(detok.rest())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # held back at least once, mid-character

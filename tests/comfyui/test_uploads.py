"""uploads.py: LoadImage's images per owner, renamed not overwritten, bounded, counted."""

from __future__ import annotations

from omni_stream.comfyui import UploadStore

from .test_book import Budget


def test_uploads_are_per_owner_renamed_when_taken_and_plain_names() -> None:
    store = UploadStore()
    first = store.put("a", "cat.png", b"1", mime="image/png", subfolder="in")
    second = store.put("a", "cat.png", b"2", mime="image/png", subfolder="in")
    assert (first.key, second.key) == ("in/cat.png", "in/cat (1).png")
    assert (
        store.put("a", "cat.png", b"3", mime="image/png", subfolder="in", overwrite=True).key == "in/cat.png"
    )
    assert store.get("a", "in/cat.png").data == b"3"  # type: ignore[union-attr]
    assert store.get("b", "in/cat.png") is None and store.names("b") == ()
    odd = store.put("a", "../../etc/pass<wd>", b"4", mime="image/png", subfolder="../x/..")
    assert (odd.name, odd.subfolder) == ("passwd", "")
    assert store.put("a", "...", b"5", mime="image/png").name == "image.png"


def test_uploads_are_bounded_per_owner_and_in_all_the_largest_holder_first() -> None:
    budget = Budget()
    store = UploadStore(per_owner=3, total=5, budget=budget)
    for i in range(4):
        store.put("flood", f"{i}.png", b"xx", mime="image/png")
    assert store.names("flood") == ("1.png", "2.png", "3.png")  # its oldest went
    store.put("honest", "mine.png", b"xx", mime="image/png")
    store.put("other", "o.png", b"xx", mime="image/png")
    assert len(store) == 5 and budget.held == 10
    store.put("other", "o2.png", b"xx", mime="image/png")  # over the total: flood holds the most
    assert store.names("flood") == ("2.png", "3.png") and store.names("honest") == ("mine.png",)
    assert len(store) == 5 and budget.held == 10

"""The lease board (kvtransfer/lease_board.py): what a same-host importer reads to know a lease is
live without asking the exporter, and when the exporter's lease table changes it."""

import os

import pytest

from pdserve.engine.shared_memory import map_region
from pdserve.kvtransfer.blocks import LeaseTable
from pdserve.kvtransfer.lease_board import BoardView, LeaseBoard, token_digest

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the board lives in a memfd (Linux)")


def test_a_published_lease_is_live_until_it_ends_and_its_generation_is_never_reused():
    board = LeaseBoard(slots=2)
    view = BoardView(board.region)
    slot, gen = board.publish("token-a")
    assert gen % 2 == 1 and view.is_live(slot, gen, token_digest("token-a"))
    assert not view.is_live(slot, gen, token_digest("token-b"))  # another lease's token
    assert not view.is_live(slot, gen + 2, token_digest("token-a")) and not view.is_live(5, gen, token_digest("token-a"))
    board.end(slot, gen)
    assert not view.is_live(slot, gen, token_digest("token-a")) and board.num_live == 0
    board.end(slot, gen)  # twice: nothing more
    again = board.publish("token-a")  # the slot comes back with a generation it never held
    assert again[0] == slot and again[1] > gen and not view.is_live(slot, gen, token_digest("token-a"))


def test_a_full_board_publishes_nothing():
    board = LeaseBoard(slots=2)
    assert board.publish("a") and board.publish("b") and board.publish("c") is None
    assert board.num_live == 2


def test_importers_map_it_read_only():
    board = LeaseBoard(slots=4)
    mapping = map_region(board.region)
    with pytest.raises(TypeError):
        mapping[0] = 1


def test_the_lease_table_publishes_each_lease_and_ends_it_before_its_blocks_go_back():
    board, clock = LeaseBoard(slots=8), [0.0]
    view = BoardView(board.region)
    seen_at_unpin = []

    def unpin(block_ids):  # what an importer reading the board sees when the engine gets the blocks back
        seen_at_unpin.append(view.is_live(*lease.board_slot, token_digest(lease.token)))

    table = LeaseTable(lambda ids: None, unpin, lease_s=5.0, clock=lambda: clock[0], board=board)
    lease = table.add("r1", [1, 2])
    assert view.is_live(*lease.board_slot, token_digest(lease.token))
    assert table.release("r1", lease.token) and seen_at_unpin == [False]

    lease = table.add("r2", [3])
    held = table.hold("r2", lease.token)  # a READ in flight: the blocks stay, the lease ends at once
    clock[0] = 10.0
    assert table.expire() == ["r2"] and not view.is_live(*lease.board_slot, token_digest(lease.token))
    table.unhold(held)
    assert seen_at_unpin == [False, False] and board.num_live == 0


def test_an_importer_sees_whether_the_exporter_still_holds_its_board():
    board = LeaseBoard(slots=2)
    assert BoardView(board.region).exporter_alive()
    gone = BoardView(type(board.region)(board.region.host, board.region.pid, board.region.fd, (0, 0),
                                        board.region.nbytes))
    assert not gone.exporter_alive()  # another file at that fd: the exporter is not the one it was

"""The suite's own xdist scheduling (``tests/support/schedule.py``): multi-process files run one after another."""

from pathlib import Path
from types import SimpleNamespace

from xdist.scheduler import LoadFileScheduling

from support.schedule import CHAIN, MULTI_PROCESS_FILES, SERVER_PAIR, SERVER_PAIR_FILES, MultiProcessFilesInOneChain

REPO = Path(__file__).resolve().parents[1]


class _Config:
    """What the schedulers read of pytest's config: two local workers, xdist's default reordering."""

    class option:
        loadscopereorder = True

    @staticmethod
    def getvalue(name):
        assert name == "tx"
        return ["2*popen"]


class _Worker:
    """A worker as the scheduler sees it: what it was sent, in order."""

    shutting_down = False

    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[list[int]] = []

    def send_runtest_some(self, indexes):
        self.sent.append(list(indexes))

    def shutdown(self):
        self.shutting_down = True


COLLECTION = [f"{path}::test_{name}" for path, names in [
    ("tests/test_many.py", "abcd"), ("tests/strategies/test_ddp.py", "abc"), ("tests/strategies/test_fsdp.py", "abc"),
    ("tests/test_other.py", "abc")] for name in names]
MANY, DDP, FSDP, OTHER = [0, 1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]


def _schedule(scheduler_type):
    """Two workers, the collection above; then the second worker finishes what it was given first."""
    scheduler = scheduler_type(_Config())
    workers = [_Worker("gw0"), _Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, COLLECTION)
    scheduler.schedule()
    second = workers[1]
    for index in second.sent[0]:
        scheduler.mark_test_complete(second, index)
    return workers


def test_every_listed_file_exists_and_is_distributed():
    for path in MULTI_PROCESS_FILES:
        text = (REPO / path).read_text()
        assert "pytest.mark.distributed" in text, path


def test_the_files_sharing_the_server_pair_exist_use_it_and_are_one_unit():
    for path in SERVER_PAIR_FILES:
        assert "streaming_servers" in (REPO / path).read_text(), path
        assert MultiProcessFilesInOneChain(_Config())._split_scope(f"{path}::test_a") == SERVER_PAIR


def test_the_multi_process_files_go_to_one_worker_first():
    first, second = _schedule(MultiProcessFilesInOneChain)
    assert first.sent == [DDP + FSDP]  # together, and before the file with the most tests
    assert second.sent == [MANY, OTHER]
    assert MultiProcessFilesInOneChain(_Config())._split_scope("tests/strategies/test_fsdp.py::test_a") == CHAIN


def test_plain_loadfile_runs_them_side_by_side():
    """The case the chain is for: with xdist's own ``loadfile`` the DDP file starts beside the file with the most
    tests, and the FSDP file goes to whichever worker frees first, here beside the DDP file."""
    first, second = _schedule(LoadFileScheduling)
    assert first.sent == [MANY]
    assert second.sent == [DDP, FSDP]

import asyncio

from ladle.operator.workqueue import WorkQueue


async def test_a_key_waits_in_the_queue_at_most_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ("a", "b", "a", "a"):
        queue.add(key)
    assert len(queue) == 2
    assert [await queue.get(), await queue.get()] == ["a", "b"]


async def test_an_event_during_processing_requeues_the_key_after_it() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    key = await queue.get()
    queue.add("a")  # arrives while a worker holds "a": no second concurrent reconcile
    assert len(queue) == 0
    queue.done(key)
    assert len(queue) == 1
    assert await queue.get() == "a"


async def test_retries_back_off_exponentially_and_reset_on_success() -> None:
    queue: WorkQueue[str] = WorkQueue(base_delay=0.01, max_delay=0.04)
    delays = [queue.retry("a") for _ in range(4)]
    assert delays == [0.01, 0.02, 0.04, 0.04]
    assert await asyncio.wait_for(queue.get(), timeout=1) == "a"
    queue.done("a")
    queue.forget("a")
    assert queue.retry("a") == 0.01
    queue.close()


async def test_events_do_not_cut_a_failing_keys_backoff_short() -> None:
    """A key failing every time it runs must not be retried at the rate events arrive (its
    own status writes, its pods): they wait for the backoff, which sees them all anyway."""
    queue: WorkQueue[str] = WorkQueue(base_delay=0.2)
    queue.add("a")
    assert await queue.get() == "a"
    queue.add("a")  # an event while the failing reconcile runs
    queue.retry("a")
    queue.done("a")
    for _ in range(5):
        queue.add("a")
    assert len(queue) == 0
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(queue.get(), timeout=2) == "a"
    assert asyncio.get_running_loop().time() - started >= 0.15
    queue.done("a")
    queue.close()


async def test_a_spec_change_is_tried_at_once_despite_a_backoff() -> None:
    queue: WorkQueue[str] = WorkQueue(base_delay=60, max_delay=600)
    queue.retry("a")
    queue.add("a", urgent=True)  # the user's fix deserves a try now
    assert await asyncio.wait_for(queue.get(), timeout=1) == "a"
    queue.done("a")
    await asyncio.sleep(0)
    assert len(queue) == 0
    # The failure count was kept: the next failure waits longer than the first.
    assert queue.retry("a") == 120
    queue.close()


async def test_urgent_keys_jump_the_queue_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ("status-1", "status-2", "edited"):
        queue.add(key)
    queue.add("new", urgent=True)
    queue.add("edited", urgent=True)  # moves up, still queued once
    assert len(queue) == 4
    order = [await queue.get() for _ in range(4)]
    assert order == ["new", "edited", "status-1", "status-2"]
    assert len(queue) == 0


async def test_an_urgent_event_during_processing_requeues_urgently() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    key = await queue.get()
    queue.add("b")
    queue.add("a", urgent=True)
    queue.done(key)
    assert await queue.get() == "a"
    assert await queue.get() == "b"


async def test_urgent_only_workers_leave_the_backlog_alone() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("status")
    reserved = asyncio.ensure_future(queue.get(urgent_only=True))
    await asyncio.sleep(0.01)
    assert not reserved.done()  # a normal key does not wake it
    queue.add("spec", urgent=True)
    assert await asyncio.wait_for(reserved, timeout=1) == "spec"
    assert await queue.get() == "status"


async def test_the_soonest_delayed_add_wins_but_never_cuts_a_backoff_short() -> None:
    """A rollout's wake in minutes must not hold back a pod that wants another look in
    seconds; a later wake changes nothing, and neither does one during a failure's backoff."""
    queue: WorkQueue[str] = WorkQueue(base_delay=60)
    loop = asyncio.get_running_loop()
    queue.add_after("a", 300)
    queue.add_after("a", 0.05)
    queue.add_after("a", 600)
    started = loop.time()
    assert await asyncio.wait_for(queue.get(), timeout=150) == "a"
    assert loop.time() - started < 150  # the 0.05 s wake, not the 300 s one
    queue.done("a")
    queue.retry("b")
    queue.add_after("b", 0.01)
    await asyncio.sleep(0.1)
    assert len(queue) == 0
    queue.close()

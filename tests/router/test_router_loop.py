"""The router's loop over real zmq sockets and a fake rank 0 in a thread: with steps now short and now long it
switches between planning ahead and planning after, and never sits out its idle poll while it has work."""
from __future__ import annotations

import secrets
import threading
import time
from types import SimpleNamespace

import numpy as np
import zmq

from lightserve.messages import BatchPlan, StepDone, decode, encode
from lightserve.router.process import IDLE_POLL_MS, Router
from tests.router.test_scheduler import add, expected_outputs, fake_rank0, make_scheduler, reset_slots


def test_the_loop_plans_ahead_after_short_steps_and_never_idles_with_work(pool):
    ctx = zmq.Context()
    names = {k: f"inproc://{k}-{secrets.token_hex(3)}" for k in ("inbox", "done", "plan", "detok")}
    inbox, step_done, to_worker, to_detok = (ctx.socket(t) for t in (zmq.PULL, zmq.PULL, zmq.PUSH, zmq.PUSH))
    for sock, name in ((inbox, "inbox"), (step_done, "done"), (to_worker, "plan"), (to_detok, "detok")):
        sock.bind(names[name])
    sched = make_scheduler(pool)
    reset_slots(pool, 64)
    prompts = {slot: [slot + 1] * (5 + slot) for slot in range(4)}
    for slot, prompt in prompts.items():
        add(sched, pool, slot, prompt, max_new=30)
    router = Router(sched, inbox, step_done, [to_worker], to_detok, ahead_max_step_s=0.02)
    timeouts = []
    drain = router._drain_inbox
    router._drain_inbox = lambda ms: (timeouts.append((ms, sched.has_work())), drain(ms))[1]
    stop = threading.Event()
    plans: list[BatchPlan] = []

    def rank0():
        plans_in, done_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        plans_in.connect(names["plan"])
        done_out.connect(names["done"])
        while not stop.is_set():
            if not plans_in.poll(50):
                continue
            plan = decode(plans_in.recv())
            plans.append(plan)
            # Every fifth step takes 30 ms (over the 20 ms limit): the next is planned after it, then ahead again.
            time.sleep(0.03 if plan.step % 5 == 0 else 0.001)
            finish = fake_rank0(pool, SimpleNamespace(plan=plan))
            done_out.send(encode(StepDone(plan.step, 0.0, finish, time.monotonic())))
        plans_in.close(linger=0)
        done_out.close(linger=0)

    worker = threading.Thread(target=rank0)
    worker.start()
    loop = threading.Thread(target=router.loop, args=(stop,))
    loop.start()
    try:
        deadline = time.monotonic() + 60
        while sched.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sched.has_work()
    finally:
        stop.set()
        loop.join(10)
        worker.join(10)
        for sock in (inbox, step_done, to_worker, to_detok):
            sock.close(linger=0)
        ctx.term()
    for slot, prompt in prompts.items():
        assert pool.output_ids(slot, 0, 30).tolist() == expected_outputs(prompt, 30), slot
    ahead = [p.step for p in plans if p.pending_inputs.size]
    after = [p.step for p in plans if p.num_decode and not p.pending_inputs.size]
    assert ahead and after, (ahead, after)
    # The loop blocks on its inbox only when it has nothing to run.
    assert not [ms for ms, busy in timeouts if ms == IDLE_POLL_MS and busy]
    assert np.all(np.diff([p.step for p in plans]) == 1)

/*
 * transfer.pml -- Promela model of the kvfence PD KV-transfer protocol (DESIGN.md, "The transfer protocol").
 *
 * Checked with Spin by verify/run.py (`make verify`). docs/verification.md says what is proven, under which
 * bounds and assumptions, and what the must-fail variants demonstrate.
 *
 * ---------------------------------------------------------------------------------------------------------
 * Actors
 *   Router   admits requests r0..r2 in order when the decode pool can hold them, reserves at decode, sends
 *            the ticket to the request's prefill worker.
 *   Decode   the decode worker's receiver thread: TransferReceiver (kvfence/pd/receiver.py) over the page pool
 *            (kvfence/kv/pool.py); frame validation, final frame, revocation, timeouts. One atomic action per
 *            event (the receiver's atomicity contract: on_frame + the payload write under one thread/lock).
 *   Engine   the decode engine thread: per-step I1 check before the step, hold, read, check after, unhold
 *            (kvfence/engine/llm_engine.py step()/_verify(), kvfence/kv/integrity.py check_reads()).
 *   Prefill(w) two prefill workers, each a TransferSender (kvfence/pd/sender.py) per request it serves:
 *            r0 and r2 on worker 0, r1 on worker 1.
 *   Net      the network: a bag of NET messages (kept sorted, so equal multisets are equal states). Any
 *            message may be lost (at any time), delayed and delivered out of order; NDUP times in a run a
 *            delivery leaves a copy behind (a duplicate, delivered or lost later). A send into a full bag is a
 *            loss. Messages that can no longer change anything (the code drops them on arrival: their
 *            transfer ended, their sender finished) are garbage-collected at once: a loss the network may
 *            do anyway, which keeps the state space small (sound because transfer ids are never reused; off
 *            under REUSE_TID).
 *   Client   aborts one decoding request at any time (client gone), mid-step included.
 *   Quiesce  when nothing at all can move, checks that everything ended and every page is free.
 *
 * Requests (CI defaults): r0 tenant A, 2 pages; r1 tenant B, 1 page; r2 tenant A, 1 page; NPAGES = 2, so
 * r1 and r2 reuse r0's pages, and r1 and r2 run concurrently. Transfer ids TID(r) = r + 1. Every request is
 * "foreign" to every other (I1 is checked per request, which is stronger than per tenant). Deep: NPAGES = 3
 * with r2 needing 2 pages (r0 and r1 concurrent, r2 reuses r0's pages).
 *
 * ---------------------------------------------------------------------------------------------------------
 * Model action                        Python code that implements it
 * ----------------------------------  ---------------------------------------------------------------------
 * Router: admission                   pd/router.py Router._route ("expect" to decode, "prefill" to prefill)
 *   + rx_reserve + Ticket             pd/worker.py DecodeWorker.on_request -> TransferReceiver.reserve
 *                                     (ValueError on a used id -> kv_integrity_error), Ticket on the data socket
 * pool_alloc1                         kv/pool.py PagePool.allocate / _take_page / _new_lease (FIFO free list)
 * pool_release1 (+ pool_reclaim)      PagePool.release / _reclaim (quarantine; holds == 0 -> free)
 * engine hold / unhold                PagePool.hold / unhold
 * stamp (tag[p] = lease)              PagePool.stamp, called from TransferReceiver.on_frame
 * rx_on_frame                         pd/receiver.py TransferReceiver.on_frame: unknown/ended -> bad_index ->
 *                                     wrong_page -> wrong_lease -> stale_lease (pool.owner) -> duplicate
 *                                     (re-ack) -> apply
 * rx_apply                            on_frame's Applied branch; DecodeWorker.on_data: cache.write_page, then
 *                                     the FrameAck (same thread: the atomicity contract)
 * rx_on_final                         TransferReceiver.on_final: count, all written, digest -> Ready / Failed
 * rx_ready                            _complete -> Ready; DecodeWorker._finish -> LLMEngine.complete_transfer
 * rx_fail                             TransferReceiver._fail (release through quarantine, assert not refused);
 *                                     DecodeWorker._fail -> LLMEngine.fail_transfer
 * rx_revoke                           TransferReceiver.revoke
 * rx_timeout (decode timeout)         DecodeWorker.on_tick: revoke(tid, "timeout") + Abort to prefill; also
 *                                     DecodeWorker.on_abort (client gone during the transfer): same calls
 * decode on Abort / AbortAck          DecodeWorker.on_data: revoke(tid, reason) / revoke(tid, "prefill_failed")
 * engine_pre                          engine/llm_engine.py LLMEngine.step: _verify(after_step=False)
 *                                     (kv/integrity.py check_reads), pool.hold
 * engine_read                         runner.run (the read), _verify(after_step=True), pool.unhold, outputs
 * engine_fail                         LLMEngine._fail_integrity -> _fail -> Scheduler.finish -> pool.release
 * client abort                        Router._abort -> DecodeWorker.on_abort -> LLMEngine.abort
 * tx_start                            PrefillWorker._try_start (ticket and prefilled request both present)
 *                                     -> TransferSender.start (page-count check, first window)
 * tx_fill                             TransferSender._fill_window; PrefillWorker._act: read_page + frame()
 * tx_on_ack                           TransferSender.on_ack (DONE: SendFinal + ReleaseLocal)
 * ReleaseLocal (sheld = 0)            PrefillWorker._act -> LLMEngine.finish_transfer
 * tx_dispatch Abort                   PrefillWorker.on_data -> TransferSender.on_abort (AbortAck + ReleaseLocal);
 *                                     an Abort whose sender does not exist yet is ignored (as the code does)
 * prefill timeout                     TransferSender.fail: NOT in the code (PrefillWorker has no on_tick);
 *                                     assumed by the default model, see docs/verification.md
 * prefill error                       PrefillWorker.on_outputs (prefill failed: Abort to decode)
 * digest                              pd/digest.py transfer_digest(page_digest(payload) ...), abstracted below
 *
 * Switches that are fault knobs of the code (kvfence/faults.py, docs/faults.md):
 *   RELEASE_NO_REVOKE = free_on_timeout;  MODE_PH_HONEST = placeholder_prefill;  CORRUPT = corrupt_frame;
 *   REUSE_TID_ROUTER = reuse_transfer_id;  TRUST_DONE + NO_OWNER_CHECK = TransferReceiver(checks=False);
 *   NO_TAG_CHECK = EngineConfig(integrity_checks=False).
 *
 * Abstractions
 *   * Page bytes are abstracted by their provenance: PAY(r,i) is "the KV of request r, logical page i";
 *     STALE is whatever an earlier request (another tenant) left in a page. Pages are never wiped.
 *   * The transfer digest is the sequence of page payloads in logical order (page_digest is injective on
 *     this abstraction): DIG = p0 + 8*p1. The code digests the bytes handed to TransferSender.frame(); with
 *     -DPROVENANCE_DIGEST the sender digests what it computed (e.g. I9 seal digests recorded at write time).
 *   * Lease ids: a global counter from 1 (0 = NO_TAG), never wrapped (asserted); the 64-bit per-pool id of
 *     the code, minus the prefix.
 *   * Layout fingerprint, schema version, payload size: not modelled (static checks, unit-tested).
 *   * Time: a timeout may fire at any moment (no clocks), which over-approximates every timeout policy.
 *
 * Buggy prefill (on by default, BYZ): the decode side must stay safe even if the prefill misbehaves the way
 * the 2026 incident did. For the 2-page request the prefill may have computed only a 1-token placeholder:
 *   MODE_PH_HONEST  TransferSender.start sees ticket 2 != computed 1 and aborts (the code as written),
 *   MODE_PH_SHORT   a sender that skips that check: 1 frame, then a final claiming 2 pages (or 1, PH_SHORT1).
 *   MODE_PH_STALE   (only with -DSTALE_PH) the caller claims 2 computed pages and ships page 1 from a stale
 *                   prefill page: count and byte digest both match.
 *
 * Properties (each assertion prints PROPERTY-VIOLATED <name> in a trail replay; CHK_<name>=0 disables it)
 *   I1   no foreign read: every page a decode step reads holds its own request's data for that index.
 *   OUT  no foreign output: a token is emitted only from a step that read no foreign data (I1 + I8).
 *   I2   no foreign write lands: a frame is applied only to a page that is LEASED, whose current owner is the
 *        frame's lease, held by the request whose prefill sent it.
 *   I3   decodable => every reserved page was written exactly once by the request's own transfer, holds that
 *        data, carries its lease as tag and owner, and (abstract) digest matched.
 *   I4   no step reads a free or reused page; a page read in a step is held and still ours or quarantined.
 *   ONE  every page is in exactly one state: FREE (no owner, no tag, no hold), QUARANTINED (no owner, held),
 *        LEASED (one owner lease, claimed by exactly one live reservation or decode request).
 *   RX   TransferReceiver.check_integrity + LLMEngine.check_integrity: every live claim's lease is current.
 *   WIN  the sender never believes a frame arrived that did not (acked implies applied), hence at most W
 *        un-applied frames in flight and, on the success path, ReleaseLocal only after every send completed.
 *   LEASE lease ids never wrap (so are never reused).
 *   CODE the Python code's own assertions (receiver._fail: "held pages it did not own"; reserve: unused id).
 *   QUI  at quiescence (nothing can move): every request ended, every page free, no sender still sending,
 *        every prefill released its local pages.
 *   ltl live: <> QUIESCENT  (every request ends and every page is free), checked with -a -f.
 *
 * Must-fail switches (verify/run.py expects a counterexample for each):
 *   TRUST_DONE        (a) receiver trusts the final frame as a "done" flag: no count, no completeness, no digest.
 *   CHECK_ONCE        (b) engine checks tags only before the first step and never after a step.
 *   RELEASE_NO_REVOKE (c) decode timeout releases the pages without revoking the transfer id (= free_on_timeout).
 *   NO_OWNER_CHECK        on_frame does not compare the frame's lease with pool.owner (the stale_lease check).
 *   DRAIN_FIRST_ACK   (d) the sender takes the first ack of a window as "everything in flight drained".
 *   REUSE_TID         (e) the router reuses r1's transfer id for r2 and reserve() does not refuse it.
 *   NO_TAG_CHECK          engine I1 checks off (EngineConfig(integrity_checks=False)).
 *   NO_PREFILL_TIMEOUT    nobody ends a stuck sender or a prefilled request whose ticket never came (the code
 *                         as it is: PrefillWorker has no timeout; the default model assumes one).
 *   NO_DIGEST_CHECK       on_final checks count and completeness but not the digest.
 *   CORRUPT               the network may damage one frame's payload (the digest must catch it).
 *   WRITE_CAN_FAIL        the caller's payload write may raise after on_frame returned Applied (a finding);
 *   WRITE_FAIL_REVOKES    ... and the fix: such a failure revokes the transfer.
 *   PROVENANCE_DIGEST     the sender digests what it computed, not the bytes it was handed (the STALE_PH fix).
 *   PH_SHORT1             also the placeholder that reports the count it wrote (1) instead of the reserved 2.
 *   STALE_PH              the MODE_PH_STALE prefill exists (a finding, see docs/verification.md).
 *   NO_LOSS               the network loses nothing (except sends into a full bag): reordering only.
 *   REUSE_TID_ROUTER      the router reuses r1's transfer id for r2 (fault knob reuse_transfer_id) and reserve()
 *                         refuses it, as the code does: r2 fails at decode and no ticket is sent.
 *   REFUSAL_ABORTS        ... and the router then aborts r2 at the prefill by request id (the fix for the
 *                         prefill-side leak; modelled as immediate, over the reliable control plane).
 *   PREFILL_TOMBSTONE     the prefill driver remembers an Abort that arrives before its sender exists (the
 *                         fix for the reordering half of NO_PREFILL_TIMEOUT's counterexample).
 */

/* ------------------------------------------------------------------ configuration */
#ifndef NPAGES
#define NPAGES 2
#endif
#ifndef NP0
#define NP0 2
#endif
#ifndef NP1
#define NP1 1
#endif
#ifndef NP2
#define NP2 1
#endif
#define NREQ 3
#define MAXP 2
#ifndef NET
#define NET 4                         /* at most 8 */
#endif
#ifndef NDUP
#define NDUP 1
#endif
#ifndef WINDOW
#define WINDOW 2
#endif
#ifndef KSTEPS
#define KSTEPS 2
#endif
#ifndef NABORT
#define NABORT 1
#endif
#ifndef BYZ
#define BYZ 1
#endif

#ifndef CHK_I1
#define CHK_I1 1
#endif
#ifndef CHK_OUT
#define CHK_OUT 1
#endif
#ifndef CHK_I2
#define CHK_I2 1
#endif
#ifndef CHK_I3
#define CHK_I3 1
#endif
#ifndef CHK_I4
#define CHK_I4 1
#endif
#ifndef CHK_ONE
#define CHK_ONE 1
#endif
#ifndef CHK_RX
#define CHK_RX 1
#endif
#ifndef CHK_WIN
#define CHK_WIN 1
#endif
#ifndef CHK_CODE
#define CHK_CODE 1
#endif
#ifndef CHK_QUI
#define CHK_QUI 1
#endif

#ifdef NO_OWNER_CHECK
#define OWNER_CHECK 0
#else
#define OWNER_CHECK 1
#endif

#define NPG(r)    ((r) == 0 -> NP0 : ((r) == 1 -> NP1 : NP2))
#if defined(REUSE_TID) || defined(REUSE_TID_ROUTER)
#define TID(r)    ((r) == 2 -> 2 : (r) + 1)
#else
#define TID(r)    ((r) + 1)
#endif
#define WORKER(r) ((r) == 1 -> 1 : 0)
#define PAY(r, i) ((r) * MAXP + (i) + 1)
#define STALE     7

/* ------------------------------------------------------------------ property assertions */
#define P_I1(c)    if :: CHK_I1    && !(c) -> printf("PROPERTY-VIOLATED I1\n");    assert(c) :: else -> skip fi
#define P_OUT(c)   if :: CHK_OUT   && !(c) -> printf("PROPERTY-VIOLATED OUT\n");   assert(c) :: else -> skip fi
#define P_I2(c)    if :: CHK_I2    && !(c) -> printf("PROPERTY-VIOLATED I2\n");    assert(c) :: else -> skip fi
#define P_I3(c)    if :: CHK_I3    && !(c) -> printf("PROPERTY-VIOLATED I3\n");    assert(c) :: else -> skip fi
#define P_I4(c)    if :: CHK_I4    && !(c) -> printf("PROPERTY-VIOLATED I4\n");    assert(c) :: else -> skip fi
#define P_ONE(c)   if :: CHK_ONE   && !(c) -> printf("PROPERTY-VIOLATED ONE\n");   assert(c) :: else -> skip fi
#define P_RX(c)    if :: CHK_RX    && !(c) -> printf("PROPERTY-VIOLATED RX\n");    assert(c) :: else -> skip fi
#define P_WIN(c)   if :: CHK_WIN   && !(c) -> printf("PROPERTY-VIOLATED WIN\n");   assert(c) :: else -> skip fi
#define P_LEASE(c) if :: !(c) -> printf("PROPERTY-VIOLATED LEASE\n"); assert(c) :: else -> skip fi
#define P_CODE(c)  if :: CHK_CODE  && !(c) -> printf("PROPERTY-VIOLATED CODE\n");  assert(c) :: else -> skip fi
#define P_QUI(c)   if :: CHK_QUI   && !(c) -> printf("PROPERTY-VIOLATED QUI\n");   assert(c) :: else -> skip fi

/* ------------------------------------------------------------------ constants */
#define FREE   0
#define LEASED 1
#define QUAR   2

#define R_NONE    0   /* transfer id never seen */
#define R_ACTIVE  1   /* TransferReceiver._active */
#define R_DONE    2   /* _ended[tid] == "completed" */
#define R_REVOKED 3   /* _ended[tid] == "revoked" */

#define S_IDLE     0  /* router: not admitted yet */
#define S_ADMITTED 1
#define S_FINISHED 2
#define S_FAILED   3
#define S_ABORTED  4
#define TERMINAL(s) ((s) >= S_FINISHED)

#define Q_NONE 0      /* decode engine: no decode request yet (transfer in progress) */
#define Q_DEC  1      /* decoding, between steps */
#define Q_MID  2      /* inside a step: checked and holding its pages, not yet read */
#define Q_END  3

#define X_NONE    0   /* TransferSender not created (ticket not arrived) */
#define X_SENDING 1
#define X_DONE    2
#define X_ABORTED 3

#define MODE_OK        0
#define MODE_PH_HONEST 1
#define MODE_PH_SHORT  2
#define MODE_PH_SHORT1 3
#define MODE_PH_STALE  4

/* messages: one int, kind | tid | r (the prefill connection = the request) | x | y | z */
#define K_TICKET 1    /* decode -> prefill: Ticket (contents: the snapshot tk_* of request r) */
#define K_ACK    2    /* decode -> prefill: FrameAck(tid, index=x) */
#define K_ABORTP 3    /* decode -> prefill: Abort(tid) */
#define K_FRAME  4    /* prefill -> decode: PageFrame(tid, index=x&1, page=x>>1, lease=y, payload=z) */
#define K_FINAL  5    /* prefill -> decode: FinalFrame(tid, num_pages=x, digest=y) */
#define K_ABORTD 6    /* prefill -> decode: Abort(tid) */
#define K_ABACK  7    /* prefill -> decode: AbortAck(tid) */
#define MK(k, t, r, x, y, z) ((k) + ((t) << 3) + ((r) << 5) + ((x) << 8) + ((y) << 12) + ((z) << 20))
#define M_K(m) ((m) & 7)
#define M_T(m) (((m) >> 3) & 3)
#define M_R(m) (((m) >> 5) & 3)
#define M_X(m) (((m) >> 8) & 15)
#define M_Y(m) (((m) >> 12) & 255)
#define M_Z(m) (((m) >> 20) & 255)
#define FOR_DEC(m)    ((m) != 0 && M_K(m) >= K_FRAME)
#define FOR_PRE(m, w) ((m) != 0 && M_K(m) <= K_ABORTP && WORKER(M_R(m)) == (w))

/* ------------------------------------------------------------------ state */
/* decode page pool (kv/pool.py) */
byte pst[NPAGES];             /* PagePool.state */
byte owner[NPAGES];           /* PagePool.owner: current lease, 0 = NO_TAG */
byte tag[NPAGES];             /* PagePool.tag: lease of the last writer */
byte holds[NPAGES];           /* PagePool.holds */
byte data[NPAGES] = STALE;    /* the KV bytes, by provenance; never wiped */
byte holder[NPAGES];          /* ghost: request + 1 the allocator handed the page to, 0 = none */
byte freeq[NPAGES];           /* PagePool._free, a FIFO; entries >= nfree are 0 */
byte nfree = NPAGES;
byte next_lease = 1;          /* PagePool._next_lease */

/* receiver (pd/receiver.py), indexed by transfer id 1..3; per page index (t*2 + i) */
byte rs[4];                   /* _active / _ended */
byte rreq[4];                 /* _Reservation.request_id */
byte rn[4];                   /* len(leases) */
bit  rtimed[4];               /* RELEASE_NO_REVOKE only: the timeout already released this reservation */
byte rpage[8];                /* leases[i].page */
byte rlease[8];               /* leases[i].lease */
byte rdig[8];                 /* digests[i] (the applied payload), 0 = None */
byte wcount[8];               /* ghost: how many frames were applied to (t, i) */

/* router and decode engine, per request */
byte rst[NREQ];               /* router's view of the request */
byte nadmit;                  /* next request to admit */
byte qst[NREQ];
byte qsteps[NREQ];
byte qpage[6];                /* the decode request's block table (r*2 + i) */
byte qlease[6];

/* prefill senders (pd/sender.py), one per request */
byte sst[NREQ];               /* TransferSender.state */
byte snext[NREQ];             /* _next */
byte sacked[NREQ];            /* _acked, as a bit mask */
byte smode[NREQ];             /* the (possibly buggy) prefill behaviour, see above */
bit  sheld[NREQ];             /* the prefill's own pages are held: from admission (the router sends the
                                 prompt to prefill and decode at once) until ReleaseLocal */
byte tk_n[NREQ];              /* Ticket contents, by request: num_pages, page_ids, lease_ids */
byte tk_page[6];
byte tk_lease[6];
byte applied[NREQ];           /* ghost: bit i set when frame i of r's sender was applied at decode */

/* network and environment */
int  bag[NET];                /* sorted descending, empties (0) last: a canonical multiset */
byte ndup;
byte naborts;
byte nwfail;                  /* WRITE_CAN_FAIL: a payload write raised (once per run) */
byte ncorrupt;                /* CORRUPT: a frame's payload was corrupted in flight (once per run) */

/* scratch (hidden: not part of the state vector; only used inside one atomic action) */
hidden byte hs, hs2, hi, hj, hk, hw, ht, hr, hp, hl, hx, hy, hok, hcnt, hc1, hc2, hc3, hrefused, htaint;
hidden int  hm, hm2;

/* ------------------------------------------------------------------ network */
/* Dead messages: ones whose delivery, now and in every future state, changes nothing but the bag (the code
 * drops them on arrival: their transfer ended at the receiver, or their sender finished). Removing them at
 * once is a loss the network may do anyway, and it merges states that differ only by such garbage.
 * This relies on transfer ids never being reused, so it is off under REUSE_TID. */
#define RX_ENDED(t) (rs[t] == R_DONE || rs[t] == R_REVOKED)
#define TX_ENDED(r) (sst[r] == X_DONE || sst[r] == X_ABORTED)
#define DEAD(m) ((M_K(m) >= K_FRAME && RX_ENDED(M_T(m))) || \
                 (M_K(m) == K_TICKET && sst[M_R(m)] != X_NONE) || \
                 (M_K(m) == K_ACK && TX_ENDED(M_R(m))) || \
                 (M_K(m) == K_ABORTP && TX_ENDED(M_R(m)) && RX_ENDED(M_T(m))))

inline net_gc() {
#ifndef REUSE_TID
  hj = 0;
  do
  :: hj < NET && bag[hj] != 0 ->
     if
     :: DEAD(bag[hj]) -> net_take(hj)
     :: else -> hj++
     fi
  :: else -> break
  od;
  hj = 0
#else
  skip
#endif
}

inline net_send(msg) {
  if
  :: bag[NET - 1] != 0 -> net_gc()        /* make room: dead messages go first */
  :: else -> skip
  fi;
  if
  :: bag[NET - 1] == 0 ->
     bag[NET - 1] = msg;
     hs = NET - 1;
     do
     :: hs > 0 && bag[hs - 1] < bag[hs] -> hm2 = bag[hs - 1]; bag[hs - 1] = bag[hs]; bag[hs] = hm2; hs--
     :: else -> break
     od
  :: else ->                              /* bag full: the message is lost */
     printf("EV net: bag full, lost kind=%d tid=%d r=%d\n", M_K(msg), M_T(msg), M_R(msg))
  fi
}

inline net_take(idx) {
  hs = idx;
  do
  :: hs < NET - 1 -> bag[hs] = bag[hs + 1]; hs++
  :: else -> break
  od;
  bag[NET - 1] = 0
}

/* Pick a message for a receiver. hk = 1: deliver it but leave a copy in the bag (a duplicate delivered
 * later); this is the network's duplication, NDUP times in a run. Delivery of the original and of the copy
 * are then independent, so this covers every duplication at any moment before the original's delivery. */
inline pick_for_decode() {
  if
  :: FOR_DEC(bag[0]) -> hj = 0; hk = 0; hw = 0
  :: ndup < NDUP && FOR_DEC(bag[0]) -> hj = 0; hk = 1; hw = 0
#ifdef WRITE_CAN_FAIL
  :: nwfail < 1 && M_K(bag[0]) == K_FRAME -> hj = 0; hk = 0; hw = 1
  :: nwfail < 1 && ndup < NDUP && M_K(bag[0]) == K_FRAME -> hj = 0; hk = 1; hw = 1
#endif
#ifdef CORRUPT
  :: ncorrupt < 1 && M_K(bag[0]) == K_FRAME -> hj = 0; hk = 0; hw = 2
#endif
  :: FOR_DEC(bag[1]) -> hj = 1; hk = 0; hw = 0
  :: ndup < NDUP && FOR_DEC(bag[1]) -> hj = 1; hk = 1; hw = 0
#ifdef WRITE_CAN_FAIL
  :: nwfail < 1 && M_K(bag[1]) == K_FRAME -> hj = 1; hk = 0; hw = 1
  :: nwfail < 1 && ndup < NDUP && M_K(bag[1]) == K_FRAME -> hj = 1; hk = 1; hw = 1
#endif
#ifdef CORRUPT
  :: ncorrupt < 1 && M_K(bag[1]) == K_FRAME -> hj = 1; hk = 0; hw = 2
#endif
  :: FOR_DEC(bag[2]) -> hj = 2; hk = 0; hw = 0
  :: ndup < NDUP && FOR_DEC(bag[2]) -> hj = 2; hk = 1; hw = 0
#ifdef WRITE_CAN_FAIL
  :: nwfail < 1 && M_K(bag[2]) == K_FRAME -> hj = 2; hk = 0; hw = 1
  :: nwfail < 1 && ndup < NDUP && M_K(bag[2]) == K_FRAME -> hj = 2; hk = 1; hw = 1
#endif
#ifdef CORRUPT
  :: ncorrupt < 1 && M_K(bag[2]) == K_FRAME -> hj = 2; hk = 0; hw = 2
#endif
#if NET > 3
  :: FOR_DEC(bag[3]) -> hj = 3; hk = 0; hw = 0
  :: ndup < NDUP && FOR_DEC(bag[3]) -> hj = 3; hk = 1; hw = 0
#ifdef WRITE_CAN_FAIL
  :: nwfail < 1 && M_K(bag[3]) == K_FRAME -> hj = 3; hk = 0; hw = 1
  :: nwfail < 1 && ndup < NDUP && M_K(bag[3]) == K_FRAME -> hj = 3; hk = 1; hw = 1
#endif
#ifdef CORRUPT
  :: ncorrupt < 1 && M_K(bag[3]) == K_FRAME -> hj = 3; hk = 0; hw = 2
#endif
#endif
#if NET > 4
  :: FOR_DEC(bag[4]) -> hj = 4; hk = 0; hw = 0
  :: ndup < NDUP && FOR_DEC(bag[4]) -> hj = 4; hk = 1; hw = 0
#ifdef WRITE_CAN_FAIL
  :: nwfail < 1 && M_K(bag[4]) == K_FRAME -> hj = 4; hk = 0; hw = 1
  :: nwfail < 1 && ndup < NDUP && M_K(bag[4]) == K_FRAME -> hj = 4; hk = 1; hw = 1
#endif
#ifdef CORRUPT
  :: ncorrupt < 1 && M_K(bag[4]) == K_FRAME -> hj = 4; hk = 0; hw = 2
#endif
#endif
#if NET > 5
  :: FOR_DEC(bag[5]) -> hj = 5; hk = 0; hw = 0
  :: ndup < NDUP && FOR_DEC(bag[5]) -> hj = 5; hk = 1; hw = 0
#ifdef WRITE_CAN_FAIL
  :: nwfail < 1 && M_K(bag[5]) == K_FRAME -> hj = 5; hk = 0; hw = 1
  :: nwfail < 1 && ndup < NDUP && M_K(bag[5]) == K_FRAME -> hj = 5; hk = 1; hw = 1
#endif
#ifdef CORRUPT
  :: ncorrupt < 1 && M_K(bag[5]) == K_FRAME -> hj = 5; hk = 0; hw = 2
#endif
#endif
#if NET > 6
  :: FOR_DEC(bag[6]) -> hj = 6; hk = 0; hw = 0
  :: ndup < NDUP && FOR_DEC(bag[6]) -> hj = 6; hk = 1; hw = 0
#ifdef WRITE_CAN_FAIL
  :: nwfail < 1 && M_K(bag[6]) == K_FRAME -> hj = 6; hk = 0; hw = 1
  :: nwfail < 1 && ndup < NDUP && M_K(bag[6]) == K_FRAME -> hj = 6; hk = 1; hw = 1
#endif
#ifdef CORRUPT
  :: ncorrupt < 1 && M_K(bag[6]) == K_FRAME -> hj = 6; hk = 0; hw = 2
#endif
#endif
#if NET > 7
  :: FOR_DEC(bag[7]) -> hj = 7; hk = 0; hw = 0
  :: ndup < NDUP && FOR_DEC(bag[7]) -> hj = 7; hk = 1; hw = 0
#ifdef WRITE_CAN_FAIL
  :: nwfail < 1 && M_K(bag[7]) == K_FRAME -> hj = 7; hk = 0; hw = 1
  :: nwfail < 1 && ndup < NDUP && M_K(bag[7]) == K_FRAME -> hj = 7; hk = 1; hw = 1
#endif
#ifdef CORRUPT
  :: ncorrupt < 1 && M_K(bag[7]) == K_FRAME -> hj = 7; hk = 0; hw = 2
#endif
#endif
  fi
}

inline pick_for_prefill(w) {
  if
  :: FOR_PRE(bag[0], w) -> hj = 0; hk = 0
  :: ndup < NDUP && FOR_PRE(bag[0], w) -> hj = 0; hk = 1
  :: FOR_PRE(bag[1], w) -> hj = 1; hk = 0
  :: ndup < NDUP && FOR_PRE(bag[1], w) -> hj = 1; hk = 1
  :: FOR_PRE(bag[2], w) -> hj = 2; hk = 0
  :: ndup < NDUP && FOR_PRE(bag[2], w) -> hj = 2; hk = 1
#if NET > 3
  :: FOR_PRE(bag[3], w) -> hj = 3; hk = 0
  :: ndup < NDUP && FOR_PRE(bag[3], w) -> hj = 3; hk = 1
#endif
#if NET > 4
  :: FOR_PRE(bag[4], w) -> hj = 4; hk = 0
  :: ndup < NDUP && FOR_PRE(bag[4], w) -> hj = 4; hk = 1
#endif
#if NET > 5
  :: FOR_PRE(bag[5], w) -> hj = 5; hk = 0
  :: ndup < NDUP && FOR_PRE(bag[5], w) -> hj = 5; hk = 1
#endif
#if NET > 6
  :: FOR_PRE(bag[6], w) -> hj = 6; hk = 0
  :: ndup < NDUP && FOR_PRE(bag[6], w) -> hj = 6; hk = 1
#endif
#if NET > 7
  :: FOR_PRE(bag[7], w) -> hj = 7; hk = 0
  :: ndup < NDUP && FOR_PRE(bag[7], w) -> hj = 7; hk = 1
#endif
  fi
}

/* take the picked message out of the bag into hm (or leave it there as a duplicate) */
inline net_recv() {
  hm = bag[hj];
  if
  :: hk -> ndup++; printf("EV net: duplicate kept in flight: kind=%d tid=%d r=%d\n", M_K(hm), M_T(hm), M_R(hm))
  :: else -> net_take(hj)
  fi
}

inline pick_nonempty() {
  if
  :: bag[0] != 0 -> hj = 0
  :: bag[1] != 0 -> hj = 1
  :: bag[2] != 0 -> hj = 2
#if NET > 3
  :: bag[3] != 0 -> hj = 3
#endif
#if NET > 4
  :: bag[4] != 0 -> hj = 4
#endif
#if NET > 5
  :: bag[5] != 0 -> hj = 5
#endif
#if NET > 6
  :: bag[6] != 0 -> hj = 6
#endif
#if NET > 7
  :: bag[7] != 0 -> hj = 7
#endif
  fi
}

/* ------------------------------------------------------------------ page pool (kv/pool.py) */
inline pool_reclaim(pg) {                 /* PagePool._reclaim */
  if
  :: holds[pg] == 0 && pst[pg] == QUAR ->
     pst[pg] = FREE; tag[pg] = 0; freeq[nfree] = pg; nfree++;
     data[pg] = STALE                     /* not wiped: its bytes are now "an earlier request's data" */
  :: else -> skip
  fi
}

inline pool_release1(pg, ls) {            /* PagePool.release for one lease; sets hrefused if refused */
  if
  :: pst[pg] == LEASED && owner[pg] == ls -> owner[pg] = 0; holder[pg] = 0; pst[pg] = QUAR; pool_reclaim(pg)
  :: else -> hrefused = 1
  fi
}

inline pool_alloc1(req) {                 /* PagePool.allocate for one page: result in hp, hl */
  hp = freeq[0];
  hs2 = 0;
  do
  :: hs2 + 1 < nfree -> freeq[hs2] = freeq[hs2 + 1]; hs2++
  :: else -> break
  od;
  nfree--;
  freeq[nfree] = 0;
  P_LEASE(next_lease < 16);
  hl = next_lease;
  next_lease++;
  owner[hp] = hl; tag[hp] = 0; pst[hp] = LEASED; holder[hp] = req + 1
}

/* ------------------------------------------------------------------ invariants ONE and RX */
inline check_inv() {
  hc1 = 0;
  do
  :: hc1 < NPAGES ->
     if
     :: pst[hc1] == FREE   -> P_ONE(owner[hc1] == 0 && holds[hc1] == 0 && tag[hc1] == 0 && holder[hc1] == 0)
     :: pst[hc1] == QUAR   -> P_ONE(owner[hc1] == 0 && holds[hc1] > 0 && holder[hc1] == 0)
     :: pst[hc1] == LEASED ->
        hcnt = 0;
        hc2 = 1;
        do
        :: hc2 < 4 ->
           if
           :: rs[hc2] == R_ACTIVE ->
              hc3 = 0;
              do
              :: hc3 < rn[hc2] ->
                 if
                 :: rpage[hc2 * 2 + hc3] == hc1 && rlease[hc2 * 2 + hc3] == owner[hc1] -> hcnt++
                 :: else -> skip
                 fi;
                 hc3++
              :: else -> break
              od
           :: else -> skip
           fi;
           hc2++
        :: else -> break
        od;
        hc2 = 0;
        do
        :: hc2 < NREQ ->
           if
           :: qst[hc2] == Q_DEC || (qst[hc2] == Q_MID && !TERMINAL(rst[hc2])) ->
              hc3 = 0;
              do
              :: hc3 < NPG(hc2) ->
                 if
                 :: qpage[hc2 * 2 + hc3] == hc1 && qlease[hc2 * 2 + hc3] == owner[hc1] -> hcnt++
                 :: else -> skip
                 fi;
                 hc3++
              :: else -> break
              od
           :: else -> skip
           fi;
           hc2++
        :: else -> break
        od;
        P_ONE(owner[hc1] != 0 && hcnt == 1)
     :: else -> P_ONE(false)
     fi;
     hc1++
  :: else -> break
  od;
  /* the free list holds exactly the FREE pages */
  hcnt = 0;
  hc1 = 0;
  do
  :: hc1 < NPAGES -> if :: pst[hc1] == FREE -> hcnt++ :: else -> skip fi; hc1++
  :: else -> break
  od;
  P_ONE(hcnt == nfree);
  /* RX: TransferReceiver.check_integrity and LLMEngine.check_integrity */
  hc2 = 1;
  do
  :: hc2 < 4 ->
     if
     :: rs[hc2] == R_ACTIVE ->
        hc3 = 0;
        do
        :: hc3 < rn[hc2] ->
           P_RX(pst[rpage[hc2 * 2 + hc3]] == LEASED && owner[rpage[hc2 * 2 + hc3]] == rlease[hc2 * 2 + hc3]);
           hc3++
        :: else -> break
        od
     :: else -> skip
     fi;
     hc2++
  :: else -> break
  od;
  hc2 = 0;
  do
  :: hc2 < NREQ ->
     if
     :: qst[hc2] == Q_DEC || (qst[hc2] == Q_MID && !TERMINAL(rst[hc2])) ->
        hc3 = 0;
        do
        :: hc3 < NPG(hc2) -> P_RX(owner[qpage[hc2 * 2 + hc3]] == qlease[hc2 * 2 + hc3]); hc3++
        :: else -> break
        od
     :: else -> skip
     fi;
     hc2++
  :: else -> break
  od;
  skip                                    /* a d_step must not end in a loop's break */
}

/* ------------------------------------------------------------------ receiver (pd/receiver.py) */
inline rx_clear(t) {                      /* forget the reservation's arrays (they are dead state) */
  rpage[t * 2] = 0; rlease[t * 2] = 0; rdig[t * 2] = 0; wcount[t * 2] = 0;
  rpage[t * 2 + 1] = 0; rlease[t * 2 + 1] = 0; rdig[t * 2 + 1] = 0; wcount[t * 2 + 1] = 0
}

inline q_clear(r) {
  qpage[r * 2] = 0; qlease[r * 2] = 0; qpage[r * 2 + 1] = 0; qlease[r * 2 + 1] = 0; qsteps[r] = 0
}

inline rx_reserve(t, req, n) {            /* TransferReceiver.reserve */
#ifndef REUSE_TID
  P_CODE(rs[t] == R_NONE);                /* "transfer id ... was already used" */
#endif
  rx_clear(t);
  rs[t] = R_ACTIVE; rreq[t] = req; rn[t] = n; rtimed[t] = 0;
  hi = 0;
  do
  :: hi < n ->
     pool_alloc1(req);
     rpage[t * 2 + hi] = hp; rlease[t * 2 + hi] = hl;
     tk_page[req * 2 + hi] = hp; tk_lease[req * 2 + hi] = hl;
     hi++
  :: else -> break
  od;
  tk_n[req] = n;
  if
  :: n == 2 -> printf("EV decode: reserve tid=%d for r%d: page %d lease %d, page %d lease %d\n", t, req,
                      rpage[t * 2], rlease[t * 2], rpage[t * 2 + 1], rlease[t * 2 + 1])
  :: else -> printf("EV decode: reserve tid=%d for r%d: page %d lease %d\n", t, req, rpage[t * 2], rlease[t * 2])
  fi
}

inline rx_fail(t) {                       /* TransferReceiver._fail */
  hr = rreq[t];
  printf("EV decode: transfer tid=%d of r%d FAILED/revoked, pages released\n", t, hr);
  rs[t] = R_REVOKED;
  hrefused = 0;
  hi = 0;
  do
  :: hi < rn[t] -> pool_release1(rpage[t * 2 + hi], rlease[t * 2 + hi]); hi++
  :: else -> break
  od;
  P_CODE(hrefused == 0);                  /* assert not refused, f"transfer {tid} held pages it did not own" */
  rx_clear(t);
  if
  :: !TERMINAL(rst[hr]) -> rst[hr] = S_FAILED; qst[hr] = Q_END
  :: else -> skip
  fi
}

inline rx_revoke(t, notify) {             /* TransferReceiver.revoke (+ the driver's Abort to prefill) */
  if
  :: rs[t] == R_ACTIVE ->
     hk = rreq[t];
     rx_fail(t);
     if
     :: notify -> net_send(MK(K_ABORTP, t, hk, 0, 0, 0))
     :: else -> skip
     fi
  :: else -> skip                         /* not active: None */
  fi
}

inline rx_ready(t) {                      /* on_final -> Ready; the decode request adopts the leases */
  hr = rreq[t];
  hi = 0;
  do
  :: hi < rn[t] ->
     hp = rpage[t * 2 + hi];
     P_I3(wcount[t * 2 + hi] == 1 && rdig[t * 2 + hi] == PAY(hr, hi) && data[hp] == PAY(hr, hi) &&
          tag[hp] == rlease[t * 2 + hi] && owner[hp] == rlease[t * 2 + hi] && pst[hp] == LEASED);
     hi++
  :: else -> break
  od;
  rs[t] = R_DONE;
  printf("EV decode: transfer tid=%d READY: r%d may decode\n", t, hr);
  if
  :: !TERMINAL(rst[hr]) && qst[hr] == Q_NONE ->
     hi = 0;
     do
     :: hi < rn[t] -> qpage[hr * 2 + hi] = rpage[t * 2 + hi]; qlease[hr * 2 + hi] = rlease[t * 2 + hi]; hi++
     :: else -> break
     od;
     qst[hr] = Q_DEC;
     qsteps[hr] = KSTEPS
  :: else ->                              /* nobody wants it any more: give the pages back */
     hi = 0;
     do
     :: hi < rn[t] -> pool_release1(rpage[t * 2 + hi], rlease[t * 2 + hi]); hi++
     :: else -> break
     od
  fi;
  rx_clear(t)
}

#define ALLWRITTEN(t) (rdig[(t) * 2] != 0 && (rn[t] < 2 || rdig[(t) * 2 + 1] != 0))
#define RXDIG(t)      (rdig[(t) * 2] + 8 * rdig[(t) * 2 + 1])

inline rx_on_final(msg) {                 /* TransferReceiver.on_final */
  ht = M_T(msg); hx = M_X(msg); hy = M_Y(msg);
  printf("EV decode: final tid=%d count=%d digest=%d\n", ht, hx, hy);
  if
  :: rs[ht] != R_ACTIVE -> skip           /* unknown_transfer / completed / revoked: dropped */
  :: else ->
#ifdef TRUST_DONE
     rx_ready(ht)                         /* (a) BUG: "transfer complete" taken as a flag */
#else
     if
     :: hx != rn[ht] -> rx_fail(ht)                                   /* page_count_mismatch */
     :: hx == rn[ht] && !ALLWRITTEN(ht) -> rx_fail(ht)                /* incomplete */
#ifndef NO_DIGEST_CHECK
     :: hx == rn[ht] && ALLWRITTEN(ht) && RXDIG(ht) != hy -> rx_fail(ht)  /* digest_mismatch */
#endif
     :: else -> rx_ready(ht)
     fi
#endif
  fi
}

inline rx_apply(t, r, i, pg, ls, pay) {   /* Applied: stamp, the caller writes the payload, then acks */
  printf("EV decode: frame tid=%d idx=%d from r%d APPLIED to page %d (lease %d, data %d)\n", t, i, r, pg, ls, pay);
  P_I2(pst[pg] == LEASED && owner[pg] == ls && holder[pg] == r + 1);
  rdig[t * 2 + i] = pay;
  wcount[t * 2 + i]++;
  tag[pg] = ls;                           /* PagePool.stamp (inside on_frame, i.e. before the write) */
  if
  :: hw ->                                /* WRITE_CAN_FAIL: the caller's write raises; on_frame already */
     printf("EV decode: ... but the payload write into page %d RAISED (tag and digest already recorded)\n", pg);
     nwfail++;                            /* recorded the digest and stamped the tag; no ack is sent */
#ifdef WRITE_FAIL_REVOKES
     rx_revoke(t, 1)                      /* the fix: a failed write revokes the transfer */
#else
     skip                                 /* the driver logs and carries on */
#endif
  :: else ->
     data[pg] = pay;                      /* the KV write (atomic with on_frame by contract) */
     applied[r] = applied[r] | (1 << i);
     net_send(MK(K_ACK, t, r, i, 0, 0))
  fi
}

inline rx_on_frame(msg) {                 /* TransferReceiver.on_frame */
  ht = M_T(msg); hr = M_R(msg); hi = M_X(msg) & 1; hp = M_X(msg) >> 1; hl = M_Y(msg); hx = M_Z(msg);
  if
  :: hw == 2 ->                           /* CORRUPT: the payload's bytes were damaged in flight */
     ncorrupt++; hx = STALE; hw = 0;
     printf("EV net: frame tid=%d idx=%d from r%d CORRUPTED in flight\n", ht, hi, hr)
  :: else -> skip
  fi;
  if
  :: rs[ht] != R_ACTIVE ->                                    /* unknown_transfer / completed / revoked */
     printf("EV decode: frame tid=%d idx=%d from r%d dropped (transfer not active)\n", ht, hi, hr)
  :: rs[ht] == R_ACTIVE && hi >= rn[ht] -> skip               /* bad_index */
  :: rs[ht] == R_ACTIVE && hi < rn[ht] && hp != rpage[ht * 2 + hi] ->                     /* wrong_page */
     printf("EV decode: frame tid=%d idx=%d from r%d dropped (wrong_page)\n", ht, hi, hr)
  :: rs[ht] == R_ACTIVE && hi < rn[ht] && hp == rpage[ht * 2 + hi] && hl != rlease[ht * 2 + hi] ->
     printf("EV decode: frame tid=%d idx=%d from r%d dropped (wrong_lease)\n", ht, hi, hr)  /* wrong_lease */
  :: else ->
     if
     :: OWNER_CHECK && owner[hp] != hl ->                     /* stale_lease */
        printf("EV decode: frame tid=%d idx=%d from r%d dropped (stale_lease)\n", ht, hi, hr)
     :: else ->
        if
        :: rdig[ht * 2 + hi] != 0 ->                             /* duplicate: ack again, never re-apply */
           printf("EV decode: frame tid=%d idx=%d duplicate: dropped, acked again\n", ht, hi);
           net_send(MK(K_ACK, ht, hr, hi, 0, 0))
        :: else -> rx_apply(ht, hr, hi, hp, hl, hx)
        fi
     fi
  fi
}

inline rx_dispatch(msg) {                 /* the decode driver (tests/test_pd_protocol.py: simulate) */
  if
  :: M_K(msg) == K_FRAME  -> rx_on_frame(msg)
  :: M_K(msg) == K_FINAL  -> rx_on_final(msg)
  :: M_K(msg) == K_ABORTD -> rx_revoke(M_T(msg), 0)
  :: M_K(msg) == K_ABACK  -> rx_revoke(M_T(msg), 0)
  :: else -> assert(false)
  fi
}

inline rx_timeout(t) {                    /* decode-side timeout (or client gone during the transfer) */
  printf("EV decode: TIMEOUT of tid=%d\n", t);
#ifdef RELEASE_NO_REVOKE
  /* (c) BUG: the pages go back to the pool, the reservation stays active, so its frames still validate */
  hk = rreq[t];
  rtimed[t] = 1;
  hi = 0;
  do
  :: hi < rn[t] -> pool_release1(rpage[t * 2 + hi], rlease[t * 2 + hi]); hi++
  :: else -> break
  od;
  if
  :: !TERMINAL(rst[hk]) -> rst[hk] = S_FAILED; qst[hk] = Q_END
  :: else -> skip
  fi;
  net_send(MK(K_ABORTP, t, hk, 0, 0, 0))
#else
  rx_revoke(t, 1)
#endif
}

/* ------------------------------------------------------------------ decode engine (engine/llm_engine.py) */
inline engine_release(r) {                /* Scheduler.finish -> pool.release(request.take_leases()) */
  hrefused = 0;
  hi = 0;
  do
  :: hi < NPG(r) -> pool_release1(qpage[r * 2 + hi], qlease[r * 2 + hi]); hi++
  :: else -> break
  od;
  skip
}

inline engine_check(r) {                  /* kv/integrity.py check_reads: owner and tag of every page */
  hi = 0;
  do
  :: hi < NPG(r) ->
     if
     :: owner[qpage[r * 2 + hi]] != qlease[r * 2 + hi] || tag[qpage[r * 2 + hi]] != qlease[r * 2 + hi] -> hok = 0
     :: else -> skip
     fi;
     hi++
  :: else -> break
  od;
  skip
}

inline engine_fail(r) {                   /* _fail_integrity -> _fail(kv_integrity_error) */
  engine_release(r);
  rst[r] = S_FAILED;
  qst[r] = Q_END;
  q_clear(r)
}

inline engine_pre(r) {                    /* step(): _verify(after_step=False), then pool.hold(plan pages) */
  hok = 1;
#ifndef NO_TAG_CHECK
#ifdef CHECK_ONCE
  if
  :: qsteps[r] == KSTEPS -> engine_check(r)   /* (b) BUG: only before the first step */
  :: else -> skip
  fi;
#else
  engine_check(r);
#endif
#endif
  if
  :: hok ->
     printf("EV engine: r%d step %d: pre-step check passed, pages held\n", r, KSTEPS - qsteps[r] + 1);
     hi = 0;
     do
     :: hi < NPG(r) -> holds[qpage[r * 2 + hi]]++; hi++
     :: else -> break
     od;
     qst[r] = Q_MID
  :: else ->
     printf("EV engine: r%d step %d: pre-step check FAILED -> kv_integrity_error\n", r, KSTEPS - qsteps[r] + 1);
     engine_fail(r)
  fi
}

inline engine_read(r) {                   /* runner.run (reads), _verify(after_step=True), unhold, emit */
  htaint = 0;
  hi = 0;
  do
  :: hi < NPG(r) ->
     hp = qpage[r * 2 + hi];
     P_I4(pst[hp] != FREE && holds[hp] > 0 && (pst[hp] == QUAR || owner[hp] == qlease[r * 2 + hi]));
     printf("EV engine: r%d reads page %d (index %d): data %d, own data is %d\n", r, hp, hi, data[hp], PAY(r, hi));
     P_I1(data[hp] == PAY(r, hi));
     if
     :: data[hp] != PAY(r, hi) -> htaint = 1
     :: else -> skip
     fi;
     hi++
  :: else -> break
  od;
  hok = 1;
#if !defined(NO_TAG_CHECK) && !defined(CHECK_ONCE)
  engine_check(r);
#endif
  hi = 0;
  do
  :: hi < NPG(r) -> hp = qpage[r * 2 + hi]; holds[hp]--; pool_reclaim(hp); hi++
  :: else -> break
  od;
  if
  :: TERMINAL(rst[r]) -> qst[r] = Q_END; q_clear(r)          /* aborted mid-step: pages already released */
  :: !TERMINAL(rst[r]) && !hok ->                           /* the token is discarded */
     printf("EV engine: r%d post-step check FAILED -> kv_integrity_error, token discarded\n", r);
     engine_fail(r)
  :: else ->
     printf("EV engine: r%d emits a token to the client\n", r);
     P_OUT(htaint == 0);                                     /* the token reaches the client */
     qsteps[r]--;
     if
     :: qsteps[r] == 0 ->
        printf("EV engine: r%d FINISHED, pages released\n", r);
        engine_release(r); rst[r] = S_FINISHED; qst[r] = Q_END; q_clear(r)
     :: else -> qst[r] = Q_DEC
     fi
  fi;
  htaint = 0
}

inline client_abort(r) {                  /* LLMEngine.abort -> Scheduler.finish(ABORTED) */
  printf("EV client: aborts r%d\n", r);
  rst[r] = S_ABORTED;
  engine_release(r);
  if
  :: qst[r] == Q_DEC -> qst[r] = Q_END; q_clear(r)
  :: else -> skip                         /* mid-step: the step still runs to its end under its holds */
  fi
}

/* ------------------------------------------------------------------ prefill sender (pd/sender.py) */
#define TX_LIMIT(r) ((smode[r] == MODE_PH_SHORT || smode[r] == MODE_PH_SHORT1) -> 1 : tk_n[r])
#define TX_PAY(r, i) ((smode[r] == MODE_PH_STALE && (i) >= 1) -> STALE : PAY(r, i))
#ifdef PROVENANCE_DIGEST
#define TX_DPAY(r, i) ((smode[r] == MODE_PH_STALE && (i) >= 1) -> 0 : PAY(r, i))
#else
#define TX_DPAY(r, i) TX_PAY(r, i)
#endif
#define TX_DIG(r)   (TX_DPAY(r, 0) + (TX_LIMIT(r) == 2 -> 8 * TX_DPAY(r, 1) : 0))
#define TX_CLAIM(r) (smode[r] == MODE_PH_SHORT1 -> 1 : tk_n[r])
#define POP2(x)     (((x) & 1) + (((x) >> 1) & 1))

inline tx_end(r) {                        /* a finished sender's counters are dead state: forget them */
  snext[r] = 0; sacked[r] = 0; applied[r] = 0; smode[r] = 0;
  tk_page[r * 2] = 0; tk_lease[r * 2] = 0; tk_page[r * 2 + 1] = 0; tk_lease[r * 2 + 1] = 0
}

inline tx_abort(r, notify) {              /* TransferSender._abort: SendAbort + ReleaseLocal */
  printf("EV prefill: sender of r%d ABORTED (notify decode=%d), local pages released\n", r, notify);
  sst[r] = X_ABORTED;
  sheld[r] = 0;
  tx_end(r);
  if
  :: notify -> net_send(MK(K_ABORTD, TID(r), r, 0, 0, 0))
  :: else -> net_send(MK(K_ABACK, TID(r), r, 0, 0, 0))
  fi
}

inline tx_fill(r) {                       /* TransferSender._fill_window + frame() per index */
  do
  :: snext[r] < TX_LIMIT(r) && snext[r] - POP2(sacked[r]) < WINDOW ->
     printf("EV prefill: r%d sends frame tid=%d idx=%d -> page %d lease %d, data %d\n", r, TID(r), snext[r],
            tk_page[r * 2 + snext[r]], tk_lease[r * 2 + snext[r]], TX_PAY(r, snext[r]));
     net_send(MK(K_FRAME, TID(r), r, (snext[r] & 1) + 2 * tk_page[r * 2 + snext[r]],
                 tk_lease[r * 2 + snext[r]], TX_PAY(r, snext[r])));
     snext[r]++
  :: else -> break
  od;
  skip
}

inline tx_start(r) {                      /* TransferSender(ticket, num_local_pages, ...).start() */
  printf("EV prefill: ticket for r%d arrives, sender starts (mode %d)\n", r, smode[r]);
  sst[r] = X_SENDING; snext[r] = 0; sacked[r] = 0;
  if
  :: smode[r] == MODE_PH_HONEST -> tx_abort(r, 1)   /* page_count_mismatch: ticket 2, computed 1 */
  :: else -> tx_fill(r)
  fi
}

inline tx_on_ack(r, i) {                  /* TransferSender.on_ack */
  if
  :: sst[r] != X_SENDING || i >= snext[r] || ((sacked[r] >> i) & 1) -> skip   /* late, bogus or repeated */
  :: else ->
#ifdef DRAIN_FIRST_ACK
     sacked[r] = (1 << snext[r]) - 1;     /* (d) BUG: the first ack of the window marks all of it drained */
#else
     sacked[r] = sacked[r] | (1 << i);
#endif
     printf("EV prefill: r%d got ack idx=%d\n", r, i);
     P_WIN((sacked[r] & (255 - applied[r])) == 0);
     if
     :: snext[r] == TX_LIMIT(r) && sacked[r] == (1 << TX_LIMIT(r)) - 1 ->
        sst[r] = X_DONE;
        printf("EV prefill: r%d DONE: final count=%d digest=%d, ReleaseLocal\n", r, TX_CLAIM(r), TX_DIG(r));
        net_send(MK(K_FINAL, TID(r), r, TX_CLAIM(r), TX_DIG(r), 0));
        P_WIN(applied[r] == (1 << TX_LIMIT(r)) - 1);   /* ReleaseLocal only after every send completed */
        sheld[r] = 0;
        tx_end(r)
     :: else -> tx_fill(r)
     fi
  fi
}

inline tx_dispatch(msg) {           /* the prefill driver: one sender per (worker, transfer id) */
  hr = M_R(msg);
  if
  :: M_K(msg) == K_TICKET ->
     if
     :: sst[hr] == X_NONE -> tx_start(hr)
     :: else -> skip                      /* duplicate ticket */
     fi
  :: M_K(msg) == K_ACK -> tx_on_ack(hr, M_X(msg))
  :: M_K(msg) == K_ABORTP ->              /* TransferSender.on_abort */
     if
     :: sst[hr] == X_SENDING -> tx_abort(hr, 0)
     :: sst[hr] == X_DONE || sst[hr] == X_ABORTED -> net_send(MK(K_ABACK, TID(hr), hr, 0, 0, 0))
     :: else ->                           /* no sender (yet): the ticket has not arrived */
#ifdef PREFILL_TOMBSTONE
        /* the fix: remember the abort, so that the late ticket finds the transfer already aborted */
        printf("EV prefill: Abort for tid=%d of r%d before its sender exists: remembered\n", M_T(msg), hr);
        sst[hr] = X_ABORTED;
        sheld[hr] = 0;                    /* PrefillWorker.on_abort: finish_transfer of a prefilled request */
        net_send(MK(K_ABACK, TID(hr), hr, 0, 0, 0))
#else
        printf("EV prefill: Abort for tid=%d of r%d before its sender exists: ignored\n", M_T(msg), hr)
#endif
     fi
  :: else -> assert(false)
  fi
}

/* ------------------------------------------------------------------ quiescence */
#if NPAGES == 2
#define ALLFREE (pst[0] == FREE && pst[1] == FREE)
#else
#define ALLFREE (pst[0] == FREE && pst[1] == FREE && pst[2] == FREE)
#endif
#define QUIESCENT (TERMINAL(rst[0]) && TERMINAL(rst[1]) && TERMINAL(rst[2]) && ALLFREE && \
                   sst[0] != X_SENDING && sst[1] != X_SENDING && sst[2] != X_SENDING && \
                   sheld[0] == 0 && sheld[1] == 0 && sheld[2] == 0)

ltl live { <> (QUIESCENT) }

/* ------------------------------------------------------------------ processes */
#ifdef REUSE_TID_ROUTER
#define REFUSED2 (nadmit == 2 && rs[TID(2)] != R_NONE)
#else
#define REFUSED2 false
#endif

active proctype Router() {
  d_step {
    hi = 0;
    do
    :: hi < NPAGES -> freeq[hi] = hi; hi++
    :: else -> break
    od;
    hi = 0
  };
  do
#ifdef REUSE_TID_ROUTER
  :: d_step {                             /* the router reuses r1's transfer id for r2 (the reuse_transfer_id */
       REFUSED2 ->                        /* knob); reserve() raises: r2 fails, no ticket is ever sent */
       printf("EV decode: reserve tid=%d for r2 REFUSED: transfer id already used -> kv_integrity_error\n", TID(2));
       rst[2] = S_FAILED; qst[2] = Q_END;
       sheld[2] = 1;                      /* the router sent the prompt to prefill all the same */
#ifdef REFUSAL_ABORTS
       /* the fix: the router treats the refusal like an error and aborts the prefill by request id on the
        * control plane (PrefillWorker.on_abort -> finish_transfer); not by transfer id, which is the one
        * that collided (an Abort/AbortAck keyed by it would revoke r1's transfer) */
       printf("EV router: aborts r2 at the prefill (by request id)\n");
       sheld[2] = 0; sst[2] = X_ABORTED;
#endif
       nadmit++
     }
#endif
  :: atomic {                             /* admission (I5 is upstream); reserve at decode; ticket */
       nadmit < NREQ && nfree >= NPG(nadmit) && !REFUSED2 ->
       /* how the prefill will behave for this request (a global, so that it survives backtracking) */
       if
       :: smode[nadmit] = MODE_OK
       :: BYZ && NPG(nadmit) == 2 -> smode[nadmit] = MODE_PH_HONEST
       :: BYZ && NPG(nadmit) == 2 -> smode[nadmit] = MODE_PH_SHORT
#ifdef PH_SHORT1
       :: BYZ && NPG(nadmit) == 2 -> smode[nadmit] = MODE_PH_SHORT1
#endif
#ifdef STALE_PH
       :: NPG(nadmit) == 2 -> smode[nadmit] = MODE_PH_STALE
#endif
       fi;
       d_step {
       rx_reserve(TID(nadmit), nadmit, NPG(nadmit));
       rst[nadmit] = S_ADMITTED;
       sheld[nadmit] = 1;                 /* the prefill computes the prompt into its own pages */
       printf("EV router: admits r%d (%d pages, tid %d, prefill mode %d)\n", nadmit, NPG(nadmit), TID(nadmit), smode[nadmit]);
       net_send(MK(K_TICKET, TID(nadmit), nadmit, 0, 0, 0));
       nadmit++;
       check_inv()
       }
     }
  :: nadmit == NREQ -> break
  od
}

active proctype Decode() {
end:
  do
  :: atomic { pick_for_decode(); d_step { net_recv(); rx_dispatch(hm); net_gc(); check_inv() } }
  :: atomic {
       if
       :: rs[1] == R_ACTIVE && !rtimed[1] -> ht = 1
       :: rs[2] == R_ACTIVE && !rtimed[2] -> ht = 2
       :: rs[3] == R_ACTIVE && !rtimed[3] -> ht = 3
       fi;
       d_step { rx_timeout(ht); net_gc(); check_inv() }
     }
  od
}

active proctype Engine() {
end:
  do
  :: atomic {
       if
       :: qst[0] == Q_DEC -> hr = 0
       :: qst[1] == Q_DEC -> hr = 1
       :: qst[2] == Q_DEC -> hr = 2
       fi;
       d_step { engine_pre(hr); check_inv() }
     }
  :: atomic {
       if
       :: qst[0] == Q_MID -> hr = 0
       :: qst[1] == Q_MID -> hr = 1
       :: qst[2] == Q_MID -> hr = 2
       fi;
       d_step { engine_read(hr); check_inv() }
     }
  od
}

proctype Prefill(byte w) {
end:
  do
  :: atomic {
       pick_for_prefill(w);
       d_step { net_recv(); tx_dispatch(hm); net_gc() }
     }
#ifndef NO_PREFILL_TIMEOUT
  :: atomic {                             /* local failure or timeout: TransferSender.fail, or, for a */
       if                                 /* prefilled request whose ticket never came, the same ending */
       :: WORKER(0) == w && sheld[0] && (sst[0] == X_SENDING || sst[0] == X_NONE) -> hr = 0
       :: WORKER(1) == w && sheld[1] && (sst[1] == X_SENDING || sst[1] == X_NONE) -> hr = 1
       :: WORKER(2) == w && sheld[2] && (sst[2] == X_SENDING || sst[2] == X_NONE) -> hr = 2
       fi;
       d_step { tx_abort(hr, 1); net_gc() }
     }
#endif
  od
}

init {
  atomic { run Prefill(0); run Prefill(1) }
}

active proctype Net() {
end:
  do
#ifndef NO_LOSS
  :: atomic {                                                                  /* loss */
       pick_nonempty();
       d_step {
         printf("EV net: lost kind=%d tid=%d r=%d\n", M_K(bag[hj]), M_T(bag[hj]), M_R(bag[hj]));
         net_take(hj)
       }
     }
#else
  :: false
#endif
  od
}

active proctype Client() {
end:
  do
  :: atomic {
       if
       :: naborts < NABORT && (qst[0] == Q_DEC || qst[0] == Q_MID) && !TERMINAL(rst[0]) -> hr = 0
       :: naborts < NABORT && (qst[1] == Q_DEC || qst[1] == Q_MID) && !TERMINAL(rst[1]) -> hr = 1
       :: naborts < NABORT && (qst[2] == Q_DEC || qst[2] == Q_MID) && !TERMINAL(rst[2]) -> hr = 2
       fi;
       naborts++;
       d_step { client_abort(hr); check_inv() }
     }
  od
}

active proctype Quiesce() {
  timeout -> P_QUI(QUIESCENT && bag[0] == 0)
}

/* I10, cluster identity: who may answer for a request and who may receive its pages.
 *
 * Processes: the router, one prefill worker P, two decode members D1 and D2 (D2 compromised: it holds a valid
 * key and acts arbitrarily), and an intruder X that holds no key. Two requests: r0 placed on (P, D1), r1 on
 * (P, D2). Every message carries the sender the receiver sees (`seen`) and, as a ghost, who really sent it
 * (`origin`): with AUTH (CURVE: the principal ZAP authenticated) `seen` is `origin`; without it a sender names
 * itself as it likes. BIND is the code's binding (RouterCore._on_output / _on_request_error: only the placed
 * decode worker, the first token only from the placed prefill; PrefillRole._ticket_allowed: pages only to the
 * decode worker the router named). Properties, asserted where they could break:
 *   OUT   a client receives an output for r only if r's placed decode worker (or, for the first token, its
 *         prefill) produced it;
 *   PAGES the prefill ships r's pages only to the decode worker the router named for r.
 * Configurations (tests/test_verify.py): AUTH=1 BIND=1 holds; AUTH=1 with BIND_OUT=0 (OUT: a member answers for
 * another) or BIND_PAGES=0 (PAGES: a member takes another's pages), and AUTH=0 BIND=1 (an intruder names itself
 * a member), each give a counterexample.
 */

#ifndef AUTH
#define AUTH 1
#endif
#ifndef BIND
#define BIND 1
#endif
#ifndef BIND_OUT
#define BIND_OUT BIND     /* the router's half (fault knob unbound_outputs) */
#endif
#ifndef BIND_PAGES
#define BIND_PAGES BIND   /* the prefill's half (fault knob unbound_tickets) */
#endif

#define ROUTER 0
#define P 1
#define D1 2
#define D2 3
#define X 4
#define NREQ 2

mtype = { PREFILL, EXPECT, TICKET, PAGES, OUTPUT, FIRST, ERROR };

/* kind, request, seen sender, origin (ghost) */
chan to_router = [6] of { mtype, byte, byte, byte };
chan to_p = [6] of { mtype, byte, byte, byte };
chan to_d1 = [4] of { mtype, byte, byte, byte };
chan to_d2 = [4] of { mtype, byte, byte, byte };

byte placed[NREQ];     /* the decode worker each request is placed on */
bool delivered[NREQ];  /* the client has its final answer */

inline seen_as(me, claim, out) {
  if
  :: AUTH -> out = me
  :: !AUTH -> out = claim
  fi
}

proctype Router() {
  mtype kind; byte r, seen, origin;
  placed[0] = D1; placed[1] = D2;
  to_p ! PREFILL, 0, ROUTER, ROUTER; to_d1 ! EXPECT, 0, ROUTER, ROUTER;
  to_p ! PREFILL, 1, ROUTER, ROUTER; to_d2 ! EXPECT, 1, ROUTER, ROUTER;
end:
  do
  :: to_router ? kind, r, seen, origin ->
     if
     :: r < NREQ && !delivered[r] && kind == FIRST && (!BIND_OUT || seen == P) ->
        assert(origin == P)                           /* OUT: the first token is the prefill's */
     :: r < NREQ && !delivered[r] && (kind == OUTPUT || kind == ERROR) && (!BIND_OUT || seen == placed[r]) ->
        assert(origin == placed[r]);                  /* OUT */
        delivered[r] = true
     :: else -> skip                                  /* dropped and counted */
     fi
  od
}

proctype Prefill() {
  mtype kind; byte r, seen, origin;
  byte named[NREQ];
  bool shipped[NREQ];
  named[0] = 0; named[1] = 0;
end:
  do
  :: to_p ? kind, r, seen, origin ->
     if
     :: kind == PREFILL && seen == ROUTER && r < NREQ ->
        named[r] = placed[r];
        to_router ! FIRST, r, P, P
     :: kind == TICKET && r < NREQ && named[r] != 0 && !shipped[r] && (!BIND_PAGES || seen == named[r]) ->
        assert(origin == named[r]);                   /* PAGES: only to the decode worker the router named */
        shipped[r] = true;
        if
        :: origin == D1 -> to_d1 ! PAGES, r, P, P
        :: origin == D2 -> to_d2 ! PAGES, r, P, P
        :: else -> skip                               /* the intruder has them: the assert above fired */
        fi
     :: else -> skip
     fi
  od
}

proctype Decode1() {  /* an honest member */
  mtype kind; byte r, seen, origin;
end:
  do
  :: to_d1 ? kind, r, seen, origin ->
     if
     :: kind == EXPECT && seen == ROUTER -> to_p ! TICKET, r, D1, D1
     :: kind == PAGES && seen == P -> to_router ! OUTPUT, r, D1, D1
     :: else -> skip
     fi
  od
}

proctype Decode2() {  /* a compromised member: a valid key, arbitrary messages about any request */
  mtype kind; byte r, seen, origin, claim, who;
  byte budget = 2;
end:
  do
  :: to_d2 ? kind, r, seen, origin -> skip
  :: budget > 0 ->
     budget--;
     select(r : 0 .. NREQ - 1);
     select(claim : P .. X);
     seen_as(D2, claim, who);
     if
     :: to_router ! OUTPUT, r, who, D2
     :: to_router ! FIRST, r, who, D2
     :: to_router ! ERROR, r, who, D2
     :: to_p ! TICKET, r, who, D2
     fi
  :: budget == 0 -> break
  od
}

proctype Intruder() {  /* no key: with AUTH its handshakes fail and nothing it sends is delivered */
  byte r, claim;
  byte budget = 2;
  do
  :: budget > 0 && !AUTH ->
     budget--;
     select(r : 0 .. NREQ - 1);
     select(claim : P .. X);
     if
     :: to_router ! OUTPUT, r, claim, X
     :: to_router ! FIRST, r, claim, X
     :: to_p ! TICKET, r, claim, X
     fi
  :: else -> break
  od
}

init {
  atomic {
    run Router(); run Prefill(); run Decode1(); run Decode2(); run Intruder()
  }
}

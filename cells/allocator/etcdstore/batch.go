package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/kvstore"
)

// createsInFlight is how many create requests may be in flight at once.
// Measured with 8 allocating goroutines against one etcd process on 2
// cores (BenchmarkEtcdNewIdentity), 2 to 8 all reach 0.85-1.09 of the raw
// transaction rate and 1 only ~0.7 (requests alternate between one
// transaction and all the others); 4 sits in the middle.
const createsInFlight = 4

// maxCreateBatch bounds the create transactions in one request. etcd
// refuses a transaction with more operations than --max-txn-ops (128 by
// default) per branch; a server set lower halves it (see send).
const maxCreateBatch = 64

// createBatcher sends the create transactions of allocations that run at
// the same time in one request: a transaction without compares whose
// success branch holds each allocation's create transaction (createTxn)
// as a nested transaction. etcd evaluates each nested transaction's
// compares on their own, so every allocation keeps the guarantees and the
// failure reads of its own transaction, and still costs one transaction;
// concurrent ones share a round trip, a raft entry and a disk write
// instead of paying one each, which is most of what etcd spends on a
// small transaction.
//
// An allocation that finds nothing in flight and nobody waiting sends its
// own transaction at once, with its own context: a lone allocation waits
// for nothing and is sent exactly as without batching. The others queue,
// and the queue goes out from a goroutine of the batcher with a context of
// the backend's, since the request carries several callers' transactions
// (see sendQueued for when).
type createBatcher struct {
	// requestContext bounds one request (timeout, require leader).
	requestContext func(context.Context) (context.Context, context.CancelFunc)
	// maxBatch is maxCreateBatch, or less after a server refused a
	// request with too many operations.
	maxBatch atomic.Int32

	mu sync.Mutex
	// inFlight counts the requests in flight and inFlightItems the
	// transactions in them.
	inFlight, inFlightItems int
	queue                   []*createItem
	// ctx bounds the requests the batcher sends for queued callers: the
	// store's life, given by start and cancelled by the store's stop.
	ctx context.Context
	// stopped refuses new transactions once the backend stops.
	stopped bool
	wg      sync.WaitGroup
}

// errCreatesStopped answers transactions that come or still wait when the
// backend stops.
var errCreatesStopped = fmt.Errorf("%w: the etcd identity backend stopped", kvstore.ErrStopped)

// createItem is one allocation's create transaction.
type createItem struct {
	cli *clientv3.Client
	req *pb.TxnRequest
	// master and ref are the keys the transaction writes: one request
	// must not write a key twice.
	master, ref string
	// settle takes over the outcome of a transaction whose caller gave
	// up while it was in flight.
	settle func(*pb.TxnResponse, error)

	done chan struct{}
	// Guarded by the batcher's mu.
	state itemState
	resp  *pb.TxnResponse
	err   error
}

type itemState int

const (
	itemQueued    itemState = iota
	itemSent                // in a request in flight
	itemAbandoned           // in flight, its caller gone: settle takes it
	itemAnswered
)

func newCreateBatcher(requestContext func(context.Context) (context.Context, context.CancelFunc)) *createBatcher {
	q := &createBatcher{requestContext: requestContext}
	q.maxBatch.Store(maxCreateBatch)
	return q
}

// commit sends it and returns etcd's answer to its transaction (for a
// nested one, its own response with the request's header). When ctx ends
// first, commit returns ctx's error; settled then tells whether the
// transaction had been sent, in which case it.settle takes care of its
// outcome and the caller must not.
func (q *createBatcher) commit(ctx context.Context, it *createItem) (resp *pb.TxnResponse, settled bool, err error) {
	q.mu.Lock()
	if q.stopped || q.ctx == nil {
		q.mu.Unlock()
		return nil, false, errCreatesStopped
	}
	if q.inFlight == 0 && len(q.queue) == 0 {
		// Alone: send it now, with the caller's context.
		q.inFlight, q.inFlightItems = 1, 1
		q.mu.Unlock()
		rctx, cancel := q.requestContext(ctx)
		resp, err := commitTxn(rctx, it.cli, it.req)
		cancel()
		q.mu.Lock()
		q.answered(1)
		q.mu.Unlock()
		return resp, false, err
	}
	it.done = make(chan struct{})
	q.queue = append(q.queue, it)
	q.sendQueued()
	q.mu.Unlock()

	select {
	case <-it.done:
		return it.resp, false, it.err
	case <-ctx.Done():
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	switch it.state {
	case itemQueued:
		q.queue = slices.DeleteFunc(q.queue, func(o *createItem) bool { return o == it })
		return nil, false, ctx.Err()
	case itemSent:
		it.state = itemAbandoned
		return nil, true, ctx.Err()
	}
	return it.resp, false, it.err
}

// answered is called with mu held when a request of n transactions was
// answered: it frees the request's place and sends what queued meanwhile
// if the rule of sendQueued allows.
func (q *createBatcher) answered(n int) {
	q.inFlight--
	q.inFlightItems -= n
	q.sendQueued()
}

// sendQueued starts a request of the queued transactions, with mu held,
// when nothing is in flight, or when a place is free and the queue holds
// at least as many transactions as the requests in flight. The second
// rule keeps the requests in flight about equally large: a place that
// frees up is not spent on the one or two transactions that queued while
// the others are still being answered, which would halve the size of
// every other request.
func (q *createBatcher) sendQueued() {
	if len(q.queue) == 0 || q.inFlight >= createsInFlight ||
		(q.inFlight > 0 && len(q.queue) < q.inFlightItems) {
		return
	}
	batch := q.take()
	q.inFlight++
	q.inFlightItems += len(batch)
	q.wg.Go(func() {
		q.send(batch)
		q.mu.Lock()
		q.answered(len(batch))
		q.mu.Unlock()
	})
}

// take removes the next request's items from the queue and marks them
// sent; there is at least one. The caller holds mu. Items of another client (the kvstore
// reconnected) or writing a key already in the request wait for the next.
func (q *createBatcher) take() []*createItem {
	limit := int(q.maxBatch.Load())
	batch := make([]*createItem, 0, min(len(q.queue), limit))
	rest := q.queue[:0]
	for _, it := range q.queue {
		if len(batch) == limit || it.cli != q.queue[0].cli || writesAny(batch, it) {
			rest = append(rest, it)
			continue
		}
		it.state = itemSent
		batch = append(batch, it)
	}
	clear(q.queue[len(rest):])
	q.queue = rest
	return batch
}

func writesAny(batch []*createItem, it *createItem) bool {
	for _, o := range batch {
		if o.master == it.master || o.ref == it.ref {
			return true
		}
	}
	return false
}

// send commits batch in one request and hands each item its answer.
func (q *createBatcher) send(batch []*createItem) {
	q.mu.Lock()
	ctx := q.ctx
	q.mu.Unlock()
	rctx, cancel := q.requestContext(ctx)
	defer cancel()
	if len(batch) == 1 {
		resp, err := commitTxn(rctx, batch[0].cli, batch[0].req)
		q.answer(batch[0], resp, err)
		return
	}
	req := &pb.TxnRequest{Success: make([]*pb.RequestOp, len(batch))}
	for i, it := range batch {
		req.Success[i] = &pb.RequestOp{Request: &pb.RequestOp_RequestTxn{RequestTxn: it.req}}
	}
	resp, err := commitTxn(rctx, batch[0].cli, req)
	if err != nil && isTooManyOps(err) && len(batch) > 1 {
		// The server allows fewer operations per transaction than
		// maxCreateBatch: send these in halves, and later requests
		// no larger.
		half := len(batch) / 2
		q.maxBatch.Store(int32(half))
		q.send(batch[:half])
		q.send(batch[half:])
		return
	}
	for i, it := range batch {
		if err != nil {
			q.answer(it, nil, err)
			continue
		}
		var sub *pb.TxnResponse
		if i < len(resp.Responses) {
			sub = resp.Responses[i].GetResponseTxn()
		}
		if sub == nil {
			q.answer(it, nil, fmt.Errorf("etcd answered %d operations for %d nested transactions", len(resp.Responses), len(batch)))
			continue
		}
		// A nested transaction's response has no header of its own;
		// its writes are at the request's revision.
		sub.Header = resp.Header
		q.answer(it, sub, nil)
	}
}

func (q *createBatcher) answer(it *createItem, resp *pb.TxnResponse, err error) {
	q.mu.Lock()
	abandoned := it.state == itemAbandoned
	it.state, it.resp, it.err = itemAnswered, resp, err
	q.mu.Unlock()
	if abandoned {
		it.settle(resp, err)
		return
	}
	close(it.done)
}

// start lets the batcher send queued transactions, with requests bounded
// by ctx.
func (q *createBatcher) start(ctx context.Context) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.ctx = ctx
}

// stop refuses new transactions, answers the queued ones with
// errCreatesStopped and waits for the requests in flight, which the
// backend's stop has cancelled. No request starts after it.
func (q *createBatcher) stop() {
	q.mu.Lock()
	q.stopped = true
	queued := q.queue
	q.queue = nil
	for _, it := range queued {
		it.state = itemSent
	}
	q.mu.Unlock()
	for _, it := range queued {
		q.answer(it, nil, errCreatesStopped)
	}
	q.wg.Wait()
}

func isTooManyOps(err error) bool {
	return errors.Is(err, rpctypes.ErrTooManyOps) ||
		rpctypes.ErrorDesc(err) == rpctypes.ErrorDesc(rpctypes.ErrGRPCTooManyOps)
}

// Package eventqueue is the queue between the goroutines that report
// changes and the one goroutine that delivers them: pushing is a short
// critical section, and the consumer takes everything queued at once, in
// the order it was pushed. The allocator queues its identity changes
// here, so that allocations never wait for the observers, handlers and
// table its dispatcher delivers them to.
package eventqueue

import (
	"iter"
	"sync"
)

// Queue is a queue of T from many producers to one consumer. The consumer
// waits on Wake, then takes the queue (Take), delivers it and gives the
// chunks back (Recycle).
type Queue[T any] struct {
	mu sync.Mutex
	// pending is a list of fixed-size chunks: appending never copies the
	// values already queued, however far the consumer lags behind.
	pending [][]T
	// free holds drained full-size chunks for reuse, so that a busy
	// producer does not turn every value into garbage.
	free  [][]T
	holds int
	wake  chan struct{}
}

// New returns an empty queue.
func New[T any]() *Queue[T] {
	return &Queue[T]{wake: make(chan struct{}, 1)}
}

// ChunkLen is the number of values per chunk of the queue, and
// firstChunkLen the size of the first chunk after the consumer took the
// queue.
const (
	ChunkLen      = 512
	firstChunkLen = 16
)

// Push queues v.
func (q *Queue[T]) Push(v T) {
	q.mu.Lock()
	// Only the first value after a take wakes the consumer: it takes
	// everything queued, and a wake-up for each value would cost a
	// channel operation per push.
	first := len(q.pending) == 0
	if first || len(q.pending[len(q.pending)-1]) == cap(q.pending[len(q.pending)-1]) {
		q.pending = append(q.pending, q.newChunk(first))
	}
	last := &q.pending[len(q.pending)-1]
	*last = append(*last, v)
	q.mu.Unlock()
	if first {
		q.signal()
	}
}

// newChunk returns an empty chunk, a recycled one if there is one. The
// caller holds mu.
func (q *Queue[T]) newChunk(first bool) []T {
	if n := len(q.free); n > 0 {
		c := q.free[n-1]
		q.free[n-1] = nil
		q.free = q.free[:n-1]
		return c
	}
	if first {
		// The consumer usually takes the queue within a few values: a
		// full chunk for each would be mostly garbage.
		return make([]T, 0, firstChunkLen)
	}
	return make([]T, 0, ChunkLen)
}

// maxFreeChunks bounds the chunks kept for reuse (about 1.3 MB of the
// allocator's 40-byte events).
const maxFreeChunks = 64

// Recycle takes back drained chunks for reuse. It keeps no more than the
// drain took: the pushes until the next drain need about as many, and a
// queue that has gone quiet after a burst does not keep the burst's
// chunks.
func (q *Queue[T]) Recycle(chunks [][]T) {
	q.mu.Lock()
	defer q.mu.Unlock()
	keep := min(len(chunks), maxFreeChunks)
	if len(q.free) > keep {
		clear(q.free[keep:])
		q.free = q.free[:keep]
	}
	for _, c := range chunks {
		if cap(c) != ChunkLen || len(q.free) == keep {
			continue
		}
		// Drop the references, so that a recycled chunk keeps no
		// value alive.
		clear(c)
		q.free = append(q.free, c[:0])
	}
}

func (q *Queue[T]) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// Wake receives a value when the consumer should take the queue.
func (q *Queue[T]) Wake() <-chan struct{} { return q.wake }

// Hold keeps the consumer from taking values until Release, so that the
// values of a batch reach it in one take.
func (q *Queue[T]) Hold() {
	q.mu.Lock()
	q.holds++
	q.mu.Unlock()
}

// Release ends one Hold.
func (q *Queue[T]) Release() {
	q.mu.Lock()
	q.holds--
	q.mu.Unlock()
	q.signal()
}

// Take returns everything queued, in chunks, or nil while the queue is
// held.
func (q *Queue[T]) Take() [][]T {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.holds > 0 {
		return nil
	}
	evs := q.pending
	q.pending = nil
	return evs
}

// All iterates over the values of a list of chunks.
func All[T any](chunks [][]T) iter.Seq2[int, T] {
	return func(yield func(int, T) bool) {
		i := 0
		for _, c := range chunks {
			for _, v := range c {
				if !yield(i, v) {
					return
				}
				i++
			}
		}
	}
}

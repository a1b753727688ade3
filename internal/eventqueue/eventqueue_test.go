package eventqueue

import (
	"sync"
	"testing"
)

// TestQueueKeepsOrder pushes more than a few chunks and checks that a take
// returns every value once, in the order pushed, in chunks of at most
// ChunkLen, and that All numbers them from 0.
func TestQueueKeepsOrder(t *testing.T) {
	q := New[int]()
	const n = 3*ChunkLen + 5
	for i := range n {
		q.Push(i)
	}
	chunks := q.Take()
	for _, c := range chunks {
		if len(c) > ChunkLen {
			t.Fatalf("a chunk holds %d values, more than %d", len(c), ChunkLen)
		}
	}
	if cap(chunks[0]) != firstChunkLen {
		t.Fatalf("the first chunk after a take has capacity %d, want %d", cap(chunks[0]), firstChunkLen)
	}
	got := 0
	for i, v := range All(chunks) {
		if i != got || v != got {
			t.Fatalf("value %d is (%d, %d)", got, i, v)
		}
		got++
	}
	if got != n {
		t.Fatalf("took %d values, want %d", got, n)
	}
	if q.Take() != nil {
		t.Fatal("a second take returned values")
	}
}

// TestQueueWakesOnFirstPush checks that only the first push after a take
// wakes the consumer, which then takes everything.
func TestQueueWakesOnFirstPush(t *testing.T) {
	q := New[int]()
	woken := func() bool {
		select {
		case <-q.Wake():
			return true
		default:
			return false
		}
	}
	if woken() {
		t.Fatal("an empty queue woke its consumer")
	}
	q.Push(1)
	if !woken() {
		t.Fatal("the first push did not wake the consumer")
	}
	q.Push(2)
	if woken() {
		t.Fatal("a push to a queue not taken yet woke the consumer again")
	}
	q.Take()
	q.Push(3)
	if !woken() {
		t.Fatal("the first push after a take did not wake the consumer")
	}
}

// TestQueueHold checks that a held queue gives nothing until the hold is
// released, and that the release wakes the consumer.
func TestQueueHold(t *testing.T) {
	q := New[int]()
	q.Hold()
	q.Push(1)
	<-q.Wake()
	q.Push(2)
	if c := q.Take(); c != nil {
		t.Fatalf("a held queue gave %v", c)
	}
	q.Release()
	select {
	case <-q.Wake():
	default:
		t.Fatal("Release did not wake the consumer")
	}
	var got []int
	for _, v := range All(q.Take()) {
		got = append(got, v)
	}
	if len(got) != 2 || got[0] != 1 || got[1] != 2 {
		t.Fatalf("after the release the queue gave %v, want [1 2]", got)
	}
}

// TestQueueRecycles checks that drained full chunks are reused with their
// values cleared, at most as many as the last drain took.
func TestQueueRecycles(t *testing.T) {
	q := New[*int]()
	push := func(n int) {
		for range n {
			q.Push(new(int))
		}
	}
	push(firstChunkLen + 4*ChunkLen)
	chunks := q.Take()
	q.Recycle(chunks)
	if len(q.free) != 4 {
		t.Fatalf("%d chunks kept for reuse of 4 full ones drained", len(q.free))
	}
	for _, c := range chunks[1:] {
		for _, v := range c[:cap(c)] {
			if v != nil {
				t.Fatal("a recycled chunk still references a value")
			}
		}
	}
	// A smaller drain keeps fewer.
	push(firstChunkLen + ChunkLen)
	q.Recycle(q.Take())
	if len(q.free) > 2 {
		t.Fatalf("%d chunks kept after a drain of 2", len(q.free))
	}
	// The next pushes fill the kept chunks rather than new ones.
	kept := map[**int]bool{}
	for _, c := range q.free {
		kept[&c[:1][0]] = true
	}
	push(2 * ChunkLen)
	for i, c := range q.Take() {
		if !kept[&c[0]] {
			t.Fatalf("chunk %d of the next take is a new one, not one kept for reuse", i)
		}
	}
}

// TestQueueConcurrentProducers checks under -race that the values of many
// producers all arrive, each producer's in its order.
func TestQueueConcurrentProducers(t *testing.T) {
	type item struct{ producer, seq int }
	q := New[item]()
	const producers, each = 4, 5000
	var wg sync.WaitGroup
	for p := range producers {
		wg.Go(func() {
			for i := range each {
				q.Push(item{p, i})
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	next := make([]int, producers)
	total := 0
	consume := func() {
		chunks := q.Take()
		for _, it := range All(chunks) {
			if it.seq != next[it.producer] {
				t.Fatalf("producer %d: got %d, want %d", it.producer, it.seq, next[it.producer])
			}
			next[it.producer]++
			total++
		}
		q.Recycle(chunks)
	}
	for {
		select {
		case <-q.Wake():
			consume()
			continue
		case <-done:
		}
		break
	}
	consume()
	if total != producers*each {
		t.Fatalf("took %d values, want %d", total, producers*each)
	}
}

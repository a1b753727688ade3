// Package fanout delivers one ordered stream of values to any number of
// subscribers, each on its own goroutine with its own buffer, so that a
// slow subscriber delays only itself. The allocator's Observe is built on
// it.
package fanout

import (
	"context"
	"sync"
)

// Fanout is the set of subscribers of one stream. Its publisher makes the
// order: what it publishes reaches every subscriber in that order, after
// the replay the subscriber was given. The zero Fanout is ready to use.
type Fanout[T any] struct {
	mu     sync.Mutex
	subs   map[*subscriber[T]]struct{}
	closed bool
}

// Len returns the number of subscribers, so that a publisher with none can
// skip building what it would publish.
func (f *Fanout[T]) Len() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.subs)
}

// Publish hands vs to every subscriber's buffer; it never waits for a
// subscriber.
func (f *Fanout[T]) Publish(vs []T) {
	if len(vs) == 0 {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for s := range f.subs {
		s.push(vs)
	}
}

// Close completes every subscription once its subscriber has had what was
// published; later subscriptions get their replay, then complete.
func (f *Fanout[T]) Close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	for s := range f.subs {
		s.finish()
	}
	clear(f.subs)
}

// Subscribe calls next with replay, then with what is published from now
// on, on a goroutine of its own, until ctx ends or the Fanout is closed,
// and then complete with ctx's error or nil. To leave no gap and no
// duplicate between replay and what follows, the publisher builds replay
// and subscribes under the lock under which it publishes.
func (f *Fanout[T]) Subscribe(ctx context.Context, replay []T, next func(T), complete func(error)) {
	s := &subscriber[T]{wake: make(chan struct{}, 1)}
	s.push(replay)
	f.mu.Lock()
	if f.closed {
		s.finish()
	} else {
		if f.subs == nil {
			f.subs = map[*subscriber[T]]struct{}{}
		}
		f.subs[s] = struct{}{}
	}
	f.mu.Unlock()

	go func() {
		err := s.run(ctx, next)
		f.mu.Lock()
		delete(f.subs, s)
		f.mu.Unlock()
		complete(err)
	}()
}

// subscriber buffers values for one subscriber, so that a slow one delays
// only itself.
type subscriber[T any] struct {
	mu    sync.Mutex
	queue []T
	done  bool
	wake  chan struct{}
}

func (s *subscriber[T]) push(vs []T) {
	if len(vs) == 0 {
		return
	}
	s.mu.Lock()
	s.queue = append(s.queue, vs...)
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *subscriber[T]) finish() {
	s.mu.Lock()
	s.done = true
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *subscriber[T]) run(ctx context.Context, next func(T)) error {
	for {
		s.mu.Lock()
		batch, done := s.queue, s.done
		s.queue = nil
		s.mu.Unlock()
		for _, v := range batch {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			next(v)
		}
		if done && len(batch) == 0 {
			return nil
		}
		if len(batch) > 0 {
			continue
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-s.wake:
		}
	}
}

package allocator

import "sync/atomic"

type atomicCounter struct{ n atomic.Int64 }

// add returns the counter's value before incrementing it.
func (c *atomicCounter) add() int64 { return c.n.Add(1) - 1 }

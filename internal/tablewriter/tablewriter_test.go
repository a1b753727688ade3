package tablewriter

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/internal/eventually"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// row is the test table's object: a counter's value.
type row struct {
	id    uint32
	value int
}

func (row) TableHeader() []string { return []string{"ID", "Value"} }

func (r row) TableRow() []string { return []string{strconv.Itoa(int(r.id)), strconv.Itoa(r.value)} }

var rowIDIndex = statedb.Index[row, uint32]{
	Name:       "id",
	FromObject: func(r row) index.KeySet { return index.NewKeySet(index.Uint32(r.id)) },
	FromKey:    index.Uint32,
	Unique:     true,
}

// counter is a dirty object: its row is its value at the time of the
// write; one at 0 that has no row needs none.
type counter struct {
	id    uint32
	value int
	inRow bool
}

// event sets a row to a value as it came.
type event struct {
	id    uint32
	value int
}

// rows implements Rows and counts the transactions' rows.
type rows struct {
	table statedb.RWTable[row]
	// perTxn is the number of rows each transaction wrote.
	mu     sync.Mutex
	perTxn []int
	cur    statedb.WriteTxn
}

func (r *rows) count(txn statedb.WriteTxn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if txn != r.cur {
		r.cur = txn
		r.perTxn = append(r.perTxn, 0)
	}
	r.perTxn[len(r.perTxn)-1]++
}

func (r *rows) WriteEvent(txn statedb.WriteTxn, ev event) {
	r.count(txn)
	r.table.Insert(txn, row{id: ev.id, value: ev.value})
}

func (r *rows) Rowless(c *counter) bool { return c.value == 0 && !c.inRow }

func (r *rows) WriteDirty(txn statedb.WriteTxn, c *counter) {
	r.count(txn)
	r.table.Insert(txn, row{id: c.id, value: c.value})
	c.inRow = true
}

func newTestWriter(t *testing.T, pace Pace) (*statedb.DB, *rows, *Writer[event, *counter]) {
	t.Helper()
	db := statedb.New()
	table, err := statedb.NewTable(db, "rows", rowIDIndex)
	if err != nil {
		t.Fatal(err)
	}
	r := &rows{table: table}
	return db, r, New(db, table, Rows[event, *counter](r), pace)
}

// TestWriterChunks checks that a chunk holds at most its limit of rows,
// events first, that rowless objects cost no row and no transaction, that
// a chunk looks at no more than SkipFactor times its limit of dirty
// objects, and that changes queued while a backlog is written wait for the
// next take.
func TestWriterChunks(t *testing.T) {
	db, r, w := newTestWriter(t, Pace{ChunkRows: 10, SkipFactor: 4, RestFactor: 1})
	for i := range 5 {
		w.AddEvent(event{id: uint32(1000 + i), value: 1})
	}
	var held []*counter
	for i := range 100 {
		c := &counter{id: uint32(i)}
		if i%10 == 9 {
			c.value = 1
			held = append(held, c)
		}
		w.AddDirty(c)
	}
	numRows := func() int { return r.table.NumObjects(db.ReadTxn()) }
	if !w.WriteChunk(10, true) {
		t.Fatal("the first chunk reported nothing left")
	}
	// 5 events, then of the 40 counters looked at, 4 held ones.
	if got := numRows(); got != 9 {
		t.Fatalf("%d rows after one chunk, want 9", got)
	}
	w.AddEvent(event{id: 2000, value: 1})
	if !w.Queued() {
		t.Fatal("a change queued during a backlog is not queued")
	}
	for w.WriteChunk(10, false) {
	}
	if got := numRows(); got != 5+len(held) {
		t.Fatalf("%d rows after the backlog, want %d", got, 5+len(held))
	}
	if w.WriteChunk(10, false) || numRows() != 5+len(held) {
		t.Fatal("a chunk without take wrote the queue")
	}
	if w.WriteChunk(10, true) || w.Queued() {
		t.Fatal("rows left after the queue was written")
	}
	if got := numRows(); got != 6+len(held) {
		t.Fatalf("%d rows at the end, want %d", got, 6+len(held))
	}
	for i, n := range r.perTxn {
		if n > 10 {
			t.Fatalf("transaction %d wrote %d rows, more than the limit of 10", i, n)
		}
	}
}

// TestWriterRun checks that Run writes what is queued without being asked
// and flushes what was queued last when its context ends, and that Flush
// writes everything there is.
func TestWriterRun(t *testing.T) {
	db, r, w := newTestWriter(t, Pace{Interval: time.Millisecond, ChunkRows: 4, SkipFactor: 16, RestFactor: 1})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	value := func(id uint32) int {
		v, _, _ := r.table.Get(db.ReadTxn(), rowIDIndex.Query(id))
		return v.value
	}
	c := &counter{id: 1, value: 7}
	w.AddDirty(c)
	eventually.True(t, "the dirty counter written", func() bool { return value(1) == 7 })
	for i := range 50 {
		w.AddEvent(event{id: uint32(100 + i), value: i + 1})
	}
	cancel()
	<-done
	for i := range 50 {
		if got := value(uint32(100 + i)); got != i+1 {
			t.Fatalf("row %d is %d after Run ended, want %d", 100+i, got, i+1)
		}
	}
	w.AddDirtyFunc([]*counter{{id: 2, value: 1}, {id: 3, value: 1}}, func(c *counter) bool { return c.id != 3 })
	w.Flush()
	if value(2) != 1 || value(3) != 0 {
		t.Fatalf("after Flush: rows 2 and 3 are %d and %d, want 1 and none", value(2), value(3))
	}
}

func TestReusable(t *testing.T) {
	for _, c := range []struct {
		capacity, used int
		want           bool
	}{
		{1024, 1024, true},
		{1024, 256, true},
		{1024, 255, false},
		{maxScratch, maxScratch, true},
		{2 * maxScratch, 2 * maxScratch, false},
	} {
		if got := Reusable(c.capacity, c.used); got != c.want {
			t.Errorf("Reusable(%d, %d) = %v, want %v", c.capacity, c.used, got, c.want)
		}
	}
}

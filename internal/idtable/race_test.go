//go:build race

package idtable

// raceEnabled is set when the race detector runs, which allocates on its
// own and so upsets allocation counts.
const raceEnabled = true

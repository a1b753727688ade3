//go:build !race

package idtable

const raceEnabled = false

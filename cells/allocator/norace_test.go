//go:build !race

package allocator

const raceEnabled = false

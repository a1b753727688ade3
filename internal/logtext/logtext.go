// Package logtext keeps text from outside the agent (keys, values and
// objects that another writer put in a store) from making log lines of
// unbounded length: one hostile key must not become a log line of hundreds
// of kilobytes, repeated by every node that reads it.
package logtext

import (
	"fmt"
	"unicode/utf8"
)

// Max is the number of bytes of a value that Cap keeps.
const Max = 256

// Cap returns s if it is at most Max bytes long, and otherwise its first
// Max bytes (cut at a character boundary) followed by how long s is.
func Cap(s string) string {
	if len(s) <= Max {
		return s
	}
	cut := Max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%s… (%d bytes in all)", s[:cut], len(s))
}

// Error is an error whose text is capped as Cap caps a string; nil stays
// nil.
func Error(err error) error {
	if err == nil {
		return nil
	}
	return capped{err}
}

type capped struct{ err error }

func (c capped) Error() string { return Cap(c.err.Error()) }
func (c capped) Unwrap() error { return c.err }

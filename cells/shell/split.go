package shell

import (
	"errors"
	"fmt"
	"strings"
)

// ErrUnterminatedQuote is returned by Split for a line whose quote does not
// end, and ErrTrailingBackslash for a line ending in a lone backslash.
var (
	ErrUnterminatedQuote = errors.New("unterminated quote")
	ErrTrailingBackslash = errors.New("backslash at the end of the line")
)

// Split cuts a line typed at the interactive shell into the command's name
// and arguments, with the quoting of a POSIX shell and nothing else:
//
//   - unquoted spaces and tabs separate words;
//   - '...' keeps everything between the quotes as it is;
//   - "..." keeps everything as it is, except that a backslash before ",
//     \, $ or ` stands for that character (as in POSIX, though $ and `
//     mean nothing here);
//   - outside quotes, a backslash makes the next character literal;
//   - quoted and unquoted parts next to each other form one word, and a
//     pair of quotes with nothing between them is an empty word.
//
// Nothing is expanded or special otherwise: $, `, #, ~, *, ?, ;, &, |, <
// and > are ordinary characters. An unterminated quote or a trailing
// backslash is an error, never a guess.
func Split(line string) ([]string, error) {
	var (
		words  []string
		word   strings.Builder
		inWord bool
	)
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch c {
		case ' ', '\t':
			if inWord {
				words = append(words, word.String())
				word.Reset()
				inWord = false
			}
			continue
		case '\\':
			if i+1 == len(line) {
				return nil, ErrTrailingBackslash
			}
			i++
			word.WriteByte(line[i])
		case '\'':
			end := strings.IndexByte(line[i+1:], '\'')
			if end < 0 {
				return nil, fmt.Errorf("%w: ' at byte %d is not closed", ErrUnterminatedQuote, i)
			}
			word.WriteString(line[i+1 : i+1+end])
			i += 1 + end
		case '"':
			start, closed := i, false
			for i++; i < len(line); i++ {
				if line[i] == '"' {
					closed = true
					break
				}
				if line[i] == '\\' && i+1 < len(line) && strings.IndexByte(`"\$`+"`", line[i+1]) >= 0 {
					i++
				}
				word.WriteByte(line[i])
			}
			if !closed {
				return nil, fmt.Errorf("%w: \" at byte %d is not closed", ErrUnterminatedQuote, start)
			}
		default:
			word.WriteByte(c)
		}
		inWord = true
	}
	if inWord {
		words = append(words, word.String())
	}
	return words, nil
}

package scalebench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// sample is one series of a Prometheus text exposition.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

// snapshot is a scrape: series (the line before its value) -> sample.
type snapshot map[string]sample

// scrape reads url's /metrics with cli.
func scrape(ctx context.Context, cli *http.Client, url string) (snapshot, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := cli.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %.200s", url, resp.Status, body)
	}
	return parseExposition(string(body))
}

// parseExposition parses the text format: `name{k="v",...} value`, with
// comments and an optional timestamp after the value.
func parseExposition(text string) (snapshot, error) {
	out := snapshot{}
	for line := range strings.Lines(text) {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		s, series, err := parseLine(line)
		if err != nil {
			return nil, fmt.Errorf("metrics line %q: %w", line, err)
		}
		out[series] = s
	}
	return out, nil
}

func parseLine(line string) (sample, string, error) {
	var s sample
	i := strings.IndexAny(line, "{ ")
	if i < 0 {
		return s, "", fmt.Errorf("no value")
	}
	s.name = line[:i]
	rest := line[i:]
	if rest[0] == '{' {
		s.labels = map[string]string{}
		j := 1
		for {
			for j < len(rest) && (rest[j] == ',' || rest[j] == ' ') {
				j++
			}
			if j >= len(rest) {
				return s, "", fmt.Errorf("unterminated labels")
			}
			if rest[j] == '}' {
				j++
				break
			}
			eq := strings.IndexByte(rest[j:], '=')
			if eq < 0 || j+eq+1 >= len(rest) || rest[j+eq+1] != '"' {
				return s, "", fmt.Errorf("bad label")
			}
			key := rest[j : j+eq]
			j += eq + 2
			var val strings.Builder
			for ; j < len(rest) && rest[j] != '"'; j++ {
				if rest[j] == '\\' && j+1 < len(rest) {
					j++
					switch rest[j] {
					case 'n':
						val.WriteByte('\n')
					default:
						val.WriteByte(rest[j])
					}
					continue
				}
				val.WriteByte(rest[j])
			}
			if j >= len(rest) {
				return s, "", fmt.Errorf("unterminated label value")
			}
			j++ // the closing quote
			s.labels[key] = val.String()
		}
		rest = rest[j:]
	}
	series := line[:len(line)-len(rest)]
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return s, "", fmt.Errorf("no value")
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return s, "", err
	}
	s.value = v
	return s, series, nil
}

// delta returns after minus before, series by series: what the counters
// counted between the two scrapes. A series absent before counts from 0.
func delta(before, after snapshot) snapshot {
	out := make(snapshot, len(after))
	for k, a := range after {
		b := before[k]
		a.value -= b.value
		out[k] = a
	}
	return out
}

// sum adds the values of the series of name whose labels match.
func (s snapshot) sum(name string, match func(map[string]string) bool) float64 {
	var t float64
	for _, x := range s {
		if x.name == name && (match == nil || match(x.labels)) {
			t += x.value
		}
	}
	return t
}

// has reports whether any series of name exists.
func (s snapshot) has(name string) bool {
	for _, x := range s {
		if x.name == name {
			return true
		}
	}
	return false
}

// labelIs matches series whose label key is value.
func labelIs(key, value string) func(map[string]string) bool {
	return func(l map[string]string) bool { return l[key] == value }
}

package testproc

import (
	"fmt"
	"io"
	"net"
	"os"
)

// FreePorts returns n distinct ports that were free on 127.0.0.1 a moment
// ago. All listeners are held until every port is picked, so no port is
// returned twice. Someone else may take a port before the server binds it:
// callers retry a start that failed with "address already in use".
func FreePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("picking a free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// TailFile returns the last n bytes of the file at path, or the error in
// parentheses: it is for messages, which should show what went wrong either
// way.
func TailFile(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > n {
		f.Seek(fi.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(f)
	return string(b)
}

// ReadFrom returns the file at path from offset on (at most 1 MiB), such as
// the lines a restarted server wrote since its start.
func ReadFrom(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	f.Seek(offset, io.SeekStart)
	b, _ := io.ReadAll(io.LimitReader(f, 1<<20))
	return string(b)
}

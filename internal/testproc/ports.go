package testproc

import (
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
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

// HoldPorts keeps ports on 127.0.0.1 from being handed out while the server
// that owns them is stopped, and returns the function that lets go of them.
// A stopped server then looks like a stopped server and nothing else:
// connections are refused, and the kernel does not give its ports to a
// server of another test that asks for a free one, which the stopped
// server's clients would reach and which might answer them. The sockets
// bind without listening and set SO_REUSEADDR, so that they bind beside
// the connections the server left in TIME_WAIT; a port someone took
// already is skipped.
func HoldPorts(ports ...int) (release func()) {
	var fds []int
	for _, p := range ports {
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
		if err != nil {
			continue
		}
		syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1)
		if err := syscall.Bind(fd, &syscall.SockaddrInet4{Port: p, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
			syscall.Close(fd)
			continue
		}
		fds = append(fds, fd)
	}
	return func() {
		for _, fd := range fds {
			syscall.Close(fd)
		}
	}
}

// Bindable binds a socket that shares no port (no SO_REUSEADDR) to
// 127.0.0.1:port and closes it again: nil when nothing holds the port, the
// bind's error (syscall.EADDRINUSE) when something does.
func Bindable(port int) error {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	return syscall.Bind(fd, &syscall.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}})
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

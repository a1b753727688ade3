package shell

import (
	"context"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// hangupPoll is how often the connection of a running command is checked
// for a client that has gone.
const hangupPoll = 250 * time.Millisecond

// watchHangup cancels the connection's context when the client closes the
// connection while a command runs. A command that only waits (for a
// stalled disk, for the store of global identities) writes nothing, so the
// failed write that ends a command whose client is gone never comes: a
// probe or a script that gave up would leave it running, one goroutine per
// abandoned connection. The check polls the socket for a hangup and reads
// nothing: a client that only shut down its sending side (socat and nc do
// at the end of their input) still gets its answer, and a request sent
// ahead stays for the loop to read. stop ends the watch.
func watchHangup(conn net.Conn, cancel context.CancelFunc) (stop func()) {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return func() {}
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return func() {}
	}
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTicker(hangupPoll)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			var gone bool
			if err := rc.Control(func(fd uintptr) { gone = peerClosed(fd) }); err != nil || gone {
				cancel()
				return
			}
		}
	}()
	return func() {
		close(done)
		<-exited
	}
}

// peerClosed reports whether the other end of the unix socket fd has closed
// it: POLLHUP, which a shutdown of its sending side alone does not raise.
func peerClosed(fd uintptr) bool {
	fds := []unix.PollFd{{Fd: int32(fd)}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0 && fds[0].Revents&(unix.POLLHUP|unix.POLLERR) != 0
}

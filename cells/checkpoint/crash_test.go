package checkpoint

import (
	"bufio"
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/testproc"
)

const (
	crashChildEnv  = "CHECKPOINT_CRASH_CHILD"
	crashStartEnv  = "CHECKPOINT_CRASH_START"
	crashMaxStates = 400
)

// crashState is the state a crash child writes for sequence number k: k
// identities, so that the file's length tells which state it must equal.
func crashState(k int) []byte {
	return AppendJSON(nil, cidrIdentities(k))
}

// crashChild writes checkpoints of changing states until it is killed. It
// reports on stdout once its first write is done.
func crashChild(dir string) {
	start, _ := strconv.Atoi(os.Getenv(crashStartEnv))
	path := filepath.Join(dir, FileName)
	for seq := start; ; seq++ {
		if err := WriteFile(path, crashState(seq%crashMaxStates+1)); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if seq == start {
			fmt.Println("ready")
		}
	}
}

// TestCrashSafety kills a process that writes checkpoints in a loop at
// random moments, 60 times (CHECKPOINT_CRASH_RUNS; `make test-long` runs
// 200, -short 40): after every kill the file must be one complete state,
// and at most the one temporary file being written may be left. Four
// children run side by side, each in its own directory, because starting
// the test binary is most of the cost.
func TestCrashSafety(t *testing.T) {
	const workers = 4
	runs := 60
	if testing.Short() {
		runs = 40
	}
	runs = testproc.CountFromEnv(t, "CHECKPOINT_CRASH_RUNS", runs, workers)
	errs := make(chan error, workers)
	for w := range workers {
		dir := t.TempDir()
		go func() {
			for run := range runs / workers {
				if err := crashOnce(dir); err != nil {
					errs <- fmt.Errorf("worker %d, run %d: %w", w, run, err)
					return
				}
			}
			errs <- nil
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

func crashOnce(dir string) error {
	path := filepath.Join(dir, FileName)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), crashChildEnv+"="+dir, crashStartEnv+"="+strconv.Itoa(rand.IntN(crashMaxStates)))
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	if _, err := bufio.NewReader(out).ReadString('\n'); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return fmt.Errorf("child did not start: %w", err)
	}
	time.Sleep(time.Duration(rand.IntN(4000)) * time.Microsecond)
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	cmd.Wait()

	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	ids, invalid, err := Decode(data)
	if err != nil || len(invalid) != 0 {
		return fmt.Errorf("checkpoint does not decode after SIGKILL: %v, %v", err, invalid)
	}
	if want := crashState(len(ids)); len(ids) == 0 || !bytes.Equal(data, want) {
		return fmt.Errorf("checkpoint with %d identities is not a state the child wrote", len(ids))
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.Name() != FileName && e.Name() != FileName+tempSuffix {
			return fmt.Errorf("stray file %s", e.Name())
		}
	}
	return nil
}

package testenv

import (
	"context"
	"errors"
	"fmt"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/exampletb"
	"github.com/identityd/identityd/internal/k8stest"
)

// Config says what Start starts.
type Config struct {
	// EtcdClientPort and EtcdPeerPort are the etcd's ports on 127.0.0.1;
	// with both zero, free ones are picked. A port in use fails the start.
	EtcdClientPort, EtcdPeerPort int
	// APIServer also starts a Kubernetes API server, as StartAPIServer
	// does, keeping its objects in the etcd.
	APIServer bool
	// APIServerPort is the API server's port on 127.0.0.1; zero picks a
	// free one. A port in use fails the start.
	APIServerPort int
}

// Servers are the servers Start started. Stop ends them.
type Servers struct {
	// Etcd is the etcd.
	Etcd *Etcd
	// APIServer is the API server, nil unless Config.APIServer.
	APIServer *APIServer

	tb *exampletb.TB
}

// Start starts the servers of cfg for a program, not a test: a tool that
// runs an agent against them, or a development setup. It returns once
// they serve, or an error with everything it started stopped again. When
// ctx ends first, Start returns ctx's error and stops what it started as
// soon as the start returns. The processes also end when the program
// exits (on Linux, when it dies without calling Stop).
//
// A server not built yet is built first, for as long as that takes
// (minutes for the API server on a fresh machine; see PrebuildCommand).
func Start(ctx context.Context, cfg Config) (*Servers, error) {
	if (cfg.EtcdClientPort == 0) != (cfg.EtcdPeerPort == 0) {
		return nil, errors.New("testenv: give both etcd ports or neither")
	}
	type result struct {
		s   *Servers
		err error
	}
	done := make(chan result, 1)
	go func() {
		s, err := start(cfg)
		done <- result{s, err}
	}()
	select {
	case r := <-done:
		return r.s, r.err
	case <-ctx.Done():
		go func() {
			if r := <-done; r.s != nil {
				r.s.Stop()
			}
		}()
		return nil, fmt.Errorf("testenv: %w", ctx.Err())
	}
}

func start(cfg Config) (s *Servers, err error) {
	tb := exampletb.New("testenv")
	// The servers' helpers end a failed start as they end a failed test;
	// here that is a panic, which becomes Start's error.
	defer func() {
		if r := recover(); r != nil {
			if !tb.Failed() {
				panic(r)
			}
			tb.Finish()
			s, err = nil, fmt.Errorf("testenv: %v", r)
		}
	}()
	etcdOpts := []etcdtest.Option{etcdtest.WithUnsafeNoFsync()}
	if cfg.EtcdClientPort != 0 {
		etcdOpts = append(etcdOpts, etcdtest.WithPorts(cfg.EtcdClientPort, cfg.EtcdPeerPort))
	}
	s = &Servers{tb: tb, Etcd: &Etcd{cluster: etcdtest.StartSingle(tb, etcdOpts...)}}
	if cfg.APIServer {
		var apiOpts []k8stest.Option
		if cfg.APIServerPort != 0 {
			apiOpts = append(apiOpts, k8stest.WithPort(cfg.APIServerPort))
		}
		s.APIServer = startAPIServer(tb, s.Etcd, false, apiOpts...)
	}
	return s, nil
}

// Stop kills the servers and removes their data.
func (s *Servers) Stop() { s.tb.Finish() }

//go:build !linux

package ipcachemap

import "errors"

func openBPF(Config) (Map, OpenInfo, error) {
	return nil, OpenInfo{Kind: KindBPF}, errors.New("bpf ipcache map needs linux")
}

package kvstore

import (
	"context"
	"log/slog"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// slogCore is a zap core that hands etcd's log entries to the agent's slog
// logger, so the embedded server and the client log where and how the rest
// of the agent does instead of to stderr as JSON.
type slogCore struct {
	zapcore.LevelEnabler
	log   *slog.Logger
	attrs []slog.Attr
	// demote, when set, marks entries to log at debug level only.
	demote func(msg string) bool
}

// newZapLogger returns a zap logger writing entries at or above level to log.
// Entries for which demote returns true are logged at debug level.
func newZapLogger(log *slog.Logger, level zapcore.Level, demote func(msg string) bool) *zap.Logger {
	return zap.New(&slogCore{LevelEnabler: level, log: log, demote: demote})
}

func (c *slogCore) With(fields []zapcore.Field) zapcore.Core {
	return &slogCore{
		LevelEnabler: c.LevelEnabler,
		log:          c.log,
		attrs:        append(append([]slog.Attr(nil), c.attrs...), fieldsToAttrs(fields)...),
		demote:       c.demote,
	}
}

func (c *slogCore) Check(ent zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(ent.Level) {
		return ce.AddCore(ent, c)
	}
	return ce
}

func (c *slogCore) Write(ent zapcore.Entry, fields []zapcore.Field) error {
	attrs := append(append([]slog.Attr(nil), c.attrs...), fieldsToAttrs(fields)...)
	if ent.LoggerName != "" {
		attrs = append(attrs, slog.String("logger", ent.LoggerName))
	}
	level := slogLevel(ent.Level)
	if c.demote != nil && c.demote(ent.Message) {
		level = slog.LevelDebug
	}
	c.log.LogAttrs(context.Background(), level, ent.Message, attrs...)
	return nil
}

func (c *slogCore) Sync() error { return nil }

func slogLevel(l zapcore.Level) slog.Level {
	switch {
	case l <= zapcore.DebugLevel:
		return slog.LevelDebug
	case l == zapcore.InfoLevel:
		return slog.LevelInfo
	case l == zapcore.WarnLevel:
		return slog.LevelWarn
	default:
		return slog.LevelError
	}
}

func fieldsToAttrs(fields []zapcore.Field) []slog.Attr {
	if len(fields) == 0 {
		return nil
	}
	// The map encoder renders every zap field type (errors, durations,
	// objects) into plain values slog can print.
	enc := zapcore.NewMapObjectEncoder()
	for _, f := range fields {
		f.AddTo(enc)
	}
	attrs := make([]slog.Attr, 0, len(enc.Fields))
	for _, f := range fields {
		if v, ok := enc.Fields[f.Key]; ok {
			attrs = append(attrs, slog.Any(f.Key, v))
		}
	}
	return attrs
}
